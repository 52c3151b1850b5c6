"""Checkpoints on disk: DCP directories committed atomically, checked before they are loaded.

``directory/step-<N>`` is a ``torch.distributed.checkpoint`` directory. It is
written as ``directory/.step-<N>.partial`` and renamed by rank 0 once every rank
has finished writing (DCP's save ends with a collective after the metadata is
written), so a crash during a save leaves the previous checkpoint the latest
loadable one. Just before that rename rank 0 writes the checkpoint's manifest (each
file's size and SHA-256, see :mod:`.manifest`). Loading first checks every file
against the manifest, before anything is unpickled, then compares the checkpoint's
metadata with the state to fill and names every missing, unexpected and mis-shaped
key before anything is modified.

A checkpoint is code: DCP's ``.metadata`` and its non-tensor values are pickles, and
loading them runs whatever they name (as ``torch.load(weights_only=False)``). The
manifest catches damage, not a planted checkpoint: load only checkpoints you trust.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from hyper_parallel.dmodule.checkpoint.manifest import (
    MANIFEST,
    damage,
    manifest_order,
    write_manifest,
)
from hyper_parallel.dmodule.checkpoint.state_dict import ModelState
from hyper_parallel.dmodule.checkpoint.training_state import TrainingState
from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives, init_device_mesh
from hyper_parallel.platform import get_platform

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "PendingSave",
    "UnverifiedCheckpointWarning",
    "committed_steps",
    "latest_step",
    "load",
    "save",
    "step_path",
    "verify_checkpoint",
]

_STEP = re.compile(r"step-(\d+)")


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the state it was asked to fill; nothing was modified.

    ``missing``: keys of the state absent from the checkpoint; ``unexpected``: keys of
    the checkpoint the state does not have; ``mis_shaped``: ``{key: (saved, expected)}``.
    """

    def __init__(
        self,
        path: Path,
        missing: list[str],
        unexpected: list[str],
        mis_shaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.missing, self.unexpected, self.mis_shaped = missing, unexpected, mis_shaped
        parts = []
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {_listed(missing)}")
        if unexpected:
            parts.append(
                f"unexpected keys (in the checkpoint, not in the model): {_listed(unexpected)}"
            )
        if mis_shaped:
            shapes = [f"{k}: saved {s}, expected {e}" for k, (s, e) in mis_shaped.items()]
            parts.append(f"mis-shaped keys: {_listed(shapes)}")
        super().__init__(
            f"checkpoint {path} does not fit the state to load (nothing was modified); "
            + "; ".join(parts)
        )


class CheckpointCorruptError(ValueError):
    """A checkpoint's file is off its manifest (missing, resized, changed); nothing was read.

    ``path``: the checkpoint directory; ``file``: the damaged file in it; ``intact``: the
    newest older step whose files all match their manifest (``None``: there is none).
    """

    def __init__(self, path: Path, file: str, problem: str, intact: int | None) -> None:
        self.path, self.file, self.problem, self.intact = path, file, problem, intact
        if intact is None:
            hint = "no older checkpoint in its directory is intact"
        else:
            hint = (
                f"the newest intact checkpoint is step {intact} "
                f"({step_path(path.parent, intact)}): load it with step={intact}"
            )
        super().__init__(
            f"checkpoint {path} is damaged: {file} {problem}; nothing was read from it; {hint}"
        )


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without a manifest (saved before manifests existed) was loaded unchecked."""


def _listed(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items)} in all)"


def step_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The directory of the committed checkpoint of ``step``.

    Example::

        >>> step_path("ckpt", 10)
        PosixPath('ckpt/step-10')
    """
    return Path(directory) / f"step-{step}"


def committed_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps with a committed checkpoint in ``directory``, ascending (partial saves ignored).

    Example::

        >>> committed_steps("/nonexistent")
        []
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(
        int(m.group(1))
        for entry in root.iterdir()
        if (m := _STEP.fullmatch(entry.name)) and (entry / ".metadata").is_file()
    )


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The highest step with a committed checkpoint in ``directory`` (None if there is none).

    Partial (uncommitted) saves are ignored.

    Example::

        >>> latest_step("/nonexistent") is None
        True
    """
    steps = committed_steps(directory)
    return steps[-1] if steps else None


def verify_checkpoint(directory: str | os.PathLike[str], step: int) -> None:
    """Check every file of ``directory/step-<step>`` against its manifest (one process, no pickle).

    Raises :class:`CheckpointCorruptError` naming the file and the newest intact older
    step. A checkpoint without a manifest (saved before hp-dmodule wrote them) cannot be
    checked: it passes with an :class:`UnverifiedCheckpointWarning`.

    Example::

        verify_checkpoint("ckpt", 10)
    """
    path = step_path(directory, step)
    corrupt = _damage_error(directory, step, 1, "cpu")
    if corrupt is not None:
        raise corrupt
    if not (path / MANIFEST).is_file():
        _warn_unverified(path, stacklevel=3)


def _warn_unverified(path: Path, stacklevel: int) -> None:
    warnings.warn(
        f"checkpoint {path} has no {MANIFEST} (saved before manifests were written): "
        "its files cannot be checked for damage",
        UnverifiedCheckpointWarning,
        stacklevel=stacklevel,
    )


def _shared_damage(
    directory: str | os.PathLike[str], step: int, device_type: str
) -> CheckpointCorruptError | None:
    """:func:`verify_checkpoint`'s finding, every rank hashing its share of the files (collective).

    Each of ``n`` ranks checks the manifest and every file's size and hashes every
    ``n``-th file; the ranks agree on the first damaged file in the manifest's order, so
    every rank returns the same error (the hashing rank's words for a changed file). The
    newest intact older step is searched the same way.
    """
    platform = get_platform()
    world = platform.get_world_size() if platform.is_initialized() else 1
    return _damage_error(directory, step, world, device_type)


def _damage_error(
    directory: str | os.PathLike[str], step: int, world: int, device_type: str
) -> CheckpointCorruptError | None:
    """The error for ``step``'s first damaged file and the newest intact older step, if any.

    ``world`` processes check together (collective when above 1); 1: this process alone.
    """
    first = _first_damaged(step_path(directory, step), world, device_type)
    if first is None:
        return None
    older = [s for s in committed_steps(directory) if s < step]
    intact = next(
        (
            s
            for s in reversed(older)
            if _first_damaged(step_path(directory, s), world, device_type) is None
        ),
        None,
    )
    return CheckpointCorruptError(step_path(directory, step), first[0], first[1], intact)


def _first_damaged(path: Path, world: int, device_type: str) -> tuple[str, str] | None:
    """The first file of ``path`` off its manifest as every rank agrees, with this rank's words."""
    if world == 1:
        return damage(path)
    found = damage(path, (_rank(), world))
    order = manifest_order(path)
    clean = len(order) + 1  # the manifest itself unreadable sorts first (-1)
    position = clean
    if found is not None:
        position = order.index(found[0]) if found[0] in order else -1
    mesh = _world_mesh(device_type, world)
    wire = torch.tensor(
        [position], dtype=torch.int64, device=get_platform().device_for(device_type)
    )
    first = int(collectives.all_reduce(wire, mesh, 0, "min").item())
    if first == clean:
        return None
    name = MANIFEST if first == -1 else order[first]
    if found is not None and found[0] == name:
        return found
    # a changed file another rank hashed (sizes and the manifest every rank checks)
    return name, (
        f"has a SHA-256 other than its manifest's (found by rank {first % world}: its bytes "
        "changed after the save)"
    )


class PendingSave:
    """An asynchronous save in flight; :meth:`wait` (collective) commits it.

    Example::

        pending = save(state, "ckpt", step=10, async_save=True)
        ...  # train on
        pending.wait()
    """

    def __init__(
        self,
        future: Future[Any],
        partial: Path,
        final: Path,
        device_type: str,
        info: dict[str, Any] | None = None,
    ) -> None:
        self._future, self._partial, self.path = future, partial, final
        self._device_type, self._info = device_type, info
        self._done = False

    def wait(self) -> Path:
        """Wait for every rank's write, commit the checkpoint, and return its directory."""
        if not self._done:
            self._future.result()
            _commit(self._partial, self.path, self._device_type, self._info)
            self._done = True
        return self.path


#: The background saves' own gloo group and the default group it was made from (TorchTitan's
#: async checkpointing does the same): created on the first asynchronous save of a world,
#: which every rank calls.
_save_group_of: list[tuple[torch.distributed.ProcessGroup, torch.distributed.ProcessGroup]] = []


def _save_group() -> torch.distributed.ProcessGroup | None:
    if not torch.distributed.is_initialized():
        return None
    world = torch.distributed.group.WORLD
    for made_from, group in _save_group_of:
        if made_from is world:
            return group
    created = torch.distributed.new_group(backend="gloo")
    # every rank is in the new group: neither None nor torch's non-member marker
    assert isinstance(created, torch.distributed.ProcessGroup) and world is not None
    _save_group_of[:] = [(world, created)]  # an earlier (destroyed) world's group is of no use
    return created


def save(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    step: int,
    async_save: bool = False,
    info: dict[str, Any] | None = None,
) -> Path | PendingSave:
    """Save ``state`` (values: ``Stateful``s, state dicts, tensors) as ``directory/step-<step>``.

    Collective: every rank calls it. Each rank writes its shards; replicated values
    are written once. Committed atomically (see the module docstring), with a manifest
    of every file's size and SHA-256 (rank 0 hashes them) that also keeps ``info``
    (JSON values, e.g. the run's seed: readable without unpickling anything); an
    existing checkpoint of the same step is replaced only once the new one is complete.
    With ``async_save=True`` the state is staged and written in the background
    (``dcp.async_save``); the returned :class:`PendingSave` commits on ``wait()``.

    Example::

        save({"app": ModelState(model, optimizer), "train": train}, "ckpt", step=train.step)
    """
    final = step_path(directory, step)
    partial = final.with_name(f".step-{step}.partial")
    device_type = _device_type(state)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crashed save
        partial.mkdir(parents=True)
    agree(False, device_type)  # no rank writes before the stale partial directory is gone
    if async_save:
        # dcp writes in a thread whose collectives must not interleave with the training's
        # on the same group (gloo deadlocks on two threads' collectives): a group of its own
        future = dcp_async_save(state, checkpoint_id=str(partial), process_group=_save_group())
        return PendingSave(future, partial, final, device_type, info)  # type: ignore[arg-type]
    dcp_save(state, checkpoint_id=str(partial))
    _commit(partial, final, device_type, info)
    return final


def load(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
) -> int:
    """Load the checkpoint of ``step`` (default: the latest committed one) into ``state``.

    Collective. Tensors are filled in place, resharded onto their current layout
    (another mesh, another tp size, or plain tensors); ``Stateful`` values get
    ``load_state_dict``. Raises :class:`CheckpointMismatchError` on every rank,
    before modifying anything, when the checkpoint does not fit ``state``, and
    :class:`CheckpointCorruptError` when a file is off the checkpoint's manifest
    (checked by rank 0 before anything is unpickled). Returns the step loaded.

    Example::

        step = load({"app": ModelState(model, optimizer), "train": train}, "ckpt")
    """
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise FileNotFoundError(f"load: no committed checkpoint (step-<N>) in {directory}")
    path = step_path(directory, step)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"load: {path} is not a committed checkpoint (no .metadata)")
    corrupt = _shared_damage(directory, step, _device_type(state))
    if corrupt is not None:
        raise corrupt
    if _rank() == 0 and not (path / MANIFEST).is_file():
        _warn_unverified(path, stacklevel=3)
    metadata = FileSystemReader(str(path)).read_metadata()
    for key, value in state.items():
        if isinstance(value, TrainingState):
            own = _rank()
            saved = f"{key}.rng.rank{own}.torch" in metadata.state_dict_metadata
            value.rng_source_rank = own if saved else 0
    problem = _mismatch(state, metadata, path, _device_type(state))
    if agree(problem is not None, _device_type(state)) and problem is None:
        raise ValueError(f"load: checkpoint {path} does not fit on another rank (see its error)")
    if problem is not None:
        raise problem
    dcp_load(state, checkpoint_id=str(path))
    return step


def _mismatch(
    state: dict[str, Any], metadata: Metadata, path: Path, device_type: str = "cpu"
) -> CheckpointMismatchError | None:
    """What DCP would miss or mis-shape when loading ``metadata`` into ``state``.

    Collective: a saved key is unexpected only when no rank's ``state`` holds it (a
    pipeline stage holds only its own layers; the others hold the rest).
    """
    resolved = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(resolved, metadata)
    flat: dict[str, Any] = planner.state_dict
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    # Per-rank RNG states of other ranks are expected to be left unread.
    checked = {k for k, v in state.items() if not isinstance(v, TrainingState)}
    candidates = sorted(k for k in saved if k.split(".", 1)[0] in checked)
    held = _held_anywhere([k in flat for k in candidates], device_type)
    unexpected = [k for k, anywhere in zip(candidates, held, strict=True) if not anywhere]
    mis_shaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, value in flat.items():
        md = saved.get(key)
        if (
            isinstance(md, TensorStorageMetadata)
            and isinstance(value, torch.Tensor)
            and tuple(md.size) != tuple(value.shape)
        ):
            mis_shaped[key] = (tuple(md.size), tuple(value.shape))
    if missing or unexpected or mis_shaped:
        return CheckpointMismatchError(path, missing, unexpected, mis_shaped)
    return None


def _held_anywhere(flags: list[bool], device_type: str) -> list[bool]:
    """Element-wise: whether any rank's flag is set (every rank passes as many, same order)."""
    platform = get_platform()
    if not platform.is_initialized() or platform.get_world_size() == 1 or not flags:
        return flags
    mesh = _world_mesh(device_type, platform.get_world_size())
    counts = torch.tensor(flags, dtype=torch.int32, device=platform.device_for(device_type))
    return [bool(c) for c in collectives.all_reduce(counts, mesh, 0, "sum").tolist()]


def _commit(
    partial: Path, final: Path, device_type: str, info: dict[str, Any] | None = None
) -> None:
    """Rank 0 writes the finished ``partial``'s manifest, renames it to ``final``; every rank
    then sees it."""
    if _rank() == 0:
        write_manifest(partial, info)
        previous = final.with_name(f".{final.name}.replaced")
        if final.exists():
            shutil.rmtree(previous, ignore_errors=True)
            final.rename(previous)
        partial.rename(final)
        shutil.rmtree(previous, ignore_errors=True)
    agree(False, device_type)


def _rank() -> int:
    platform = get_platform()
    return platform.get_rank() if platform.is_initialized() else 0


def _device_type(state: dict[str, Any]) -> str:
    """The device type of the state's DTensors (what its collectives must run on)."""
    for value in state.values():
        found = value.model if isinstance(value, ModelState) else value
        if isinstance(found, torch.nn.Module):
            found = dict(found.named_parameters())
        if isinstance(found, dict):
            for tensor in found.values():
                if isinstance(tensor, DTensor):
                    return tensor.device_mesh.device_type
    return "cpu"


@functools.lru_cache(maxsize=4)
def _world_mesh(device_type: str, world_size: int) -> DeviceMesh:
    # Built once per process (a mesh creates process groups, collectively).
    return init_device_mesh(device_type, (world_size,))


def agree(flag: bool, device_type: str = "cpu") -> bool:
    """True on every rank when ``flag`` is on any (a collective over the world; also a barrier).

    Example::

        if agree(problem is not None) and problem is None:
            raise ValueError("another rank found a problem")
    """
    platform = get_platform()
    if not platform.is_initialized() or platform.get_world_size() == 1:
        return flag
    mesh = _world_mesh(device_type, platform.get_world_size())
    return collectives.any_rank(flag, mesh, platform.device_for(device_type))

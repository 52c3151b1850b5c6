"""Generator seeds of DTensor random ops: ranks that must draw alike hold one state.

A DTensor random op gives every rank its slice of one draw (``_ops/random.py``) from
torch's default generator, so ``torch.manual_seed(s)`` on every rank gives one device's
numbers and ``torch.utils.checkpoint`` replays them. That is one draw only while the
ranks' generators agree. Whether to run a collective must be decided alike on every
rank, so the rule rests on what every rank of an SPMD program observes alike: the
DTensor random ops themselves and ``torch.manual_seed`` (called on every rank, with any
seeds). Each rank remembers the generator states DTensor random ops left behind and
started from (states known to be aligned), and before each op:

- the first random op on each mesh (and device type) takes the state of the mesh's
  first rank: one broadcast per mesh axis;
- a generator reseeded since the last DTensor random op (``torch.initial_seed()``
  changed, or the state is a fresh one of that seed) forgets what was aligned: the
  next op whose result is replicated along some mesh axes checks that the ranks along
  them agree (one all-reduce of a fingerprint per axis) and, where they do not, takes
  the state of the first rank along them (one broadcast per axis);
- otherwise no collective: the state the last op left (the steady state) or a state
  known from earlier (``torch.utils.checkpoint``'s replay restores the state its
  forward started from) is used as it is; a state moved by this rank's plain draws
  (no reseed) is replaced by the mesh's stream, the state the last op left, with a
  :class:`RandomSeedWarning`. The default generator then continues from that stream:
  a checkpoint saves and restores the default generator only, so it must carry the
  stream for a replay to find the forward's draws.

Ranks whose state was replaced get a :class:`RandomSeedWarning`. Replicas therefore
agree whatever each rank's seeds, provided every rank reseeds alike (all of them, or
none; README "Seeds" states the hazard). ``HYPER_PARALLEL_RNG_CHECK=every_op`` (read
off the steady state: at a mesh's first random op and after a reseed) checks before
every op with replicated results instead (the earlier rule: one all-reduce per
replicated axis per op, no hazard). :func:`manual_seed` is torch's: the caller vouches
for the seeds (one per pipeline stage, say), and no state is synced, checked or
remembered from then on.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import get_platform

__all__ = ["CHECK_ENV_VAR", "RandomSeedWarning", "aligned_generator", "manual_seed"]

CHECK_ENV_VAR = "HYPER_PARALLEL_RNG_CHECK"
_CHECK_MODES = ("", "on_reseed", "every_op")
# states remembered per device type: a few per random op of a training step, enough for
# activation checkpointing to replay segments recomputed thousands of ops later
_KNOWN_CAPACITY = 4096


class RandomSeedWarning(UserWarning):
    """This rank's generator was not its mesh's stream: a DTensor random op drew from the stream."""


@dataclass
class _MeshRecord:
    """The mesh axes along which this rank knows the states agree, valid in reseed ``epoch``."""

    aligned: frozenset[int]
    epoch: int
    complete: bool  # every axis of size > 1 is aligned


def _state_key(state_bytes: bytes) -> int:
    """A hash of a generator state, to remember it by.

    torch's CPU generator state (5,056 bytes) is a Mersenne twister's: its head holds the
    seed and the position in the 624-word block and then the first words of the block,
    which all change at each twist; its tail holds the cached normal samples. Two states
    with equal heads and tails are one state (but for chance), and hashing 128 bytes
    instead of 5,056 keeps the steady state's cost low. Other states are hashed whole.
    """
    if len(state_bytes) == _MT_STATE_BYTES:
        return hash((state_bytes[:64], state_bytes[-64:]))
    return hash(state_bytes)


_MT_STATE_BYTES = 5056


@dataclass
class _Stream:
    """What this rank knows of one device type's default generator."""

    last: torch.Tensor | None = None  # the state the last DTensor random op left
    last_bytes: bytes = b""
    last_fresh: bool = False  # ... was its seed's fresh state (the op drew nothing)
    seed: int | None = None  # torch.initial_seed() then
    epoch: int = 0  # reseeds seen
    meshes: dict[DeviceMesh, _MeshRecord] = field(default_factory=dict)
    # key of a state a random op started from or left -> the state it drew from (None: itself)
    known: OrderedDict[int, torch.Tensor | None] = field(default_factory=OrderedDict)
    fresh: dict[int, bytes] = field(default_factory=dict)  # seed -> its fresh state
    warned_moved: bool = False
    every_op: bool = False  # HYPER_PARALLEL_RNG_CHECK, as last read

    def remember(self, state_bytes: bytes, use: torch.Tensor | None) -> None:
        known = self.known
        key = _state_key(state_bytes)
        if key in known:
            known.move_to_end(key)
        known[key] = use
        if len(known) > _KNOWN_CAPACITY:
            known.popitem(last=False)


class _SeedSync:
    """Per device type: the stream (and per mesh what is aligned); whether the caller vouches."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.trusted = False


_seed_sync = _SeedSync()


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed this rank's default generator; DTensor random ops then trust it (no sync, no check).

    torch's ``torch.distributed.tensor._random.manual_seed``: the caller vouches that
    the ranks that should draw alike got the same ``seed`` (e.g. one seed per pipeline
    stage), so random ops skip the agreement check and its collective. Raises
    ``RuntimeError`` on a rank outside ``device_mesh``, as torch.

    Example::

        manual_seed(1234, mesh)
        w.normal_()   # each rank's slice of the one-device draw after torch.manual_seed(1234)
    """
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(
            "manual_seed requires the current rank to be a part of the device mesh "
            f"{device_mesh}; rank {get_platform().get_rank()} is not in it"
        )
    _seed_sync.trusted = True
    torch.manual_seed(seed)


def _check_every_op() -> bool:
    """Whether ``HYPER_PARALLEL_RNG_CHECK`` asks for a check before every op (a bad value raises)."""
    mode = os.environ.get(CHECK_ENV_VAR, "")
    if mode not in _CHECK_MODES:
        raise ValueError(
            f"{CHECK_ENV_VAR}: expected one of 'on_reseed' (the default), 'every_op' or unset, "
            f"found {mode!r}"
        )
    return mode == "every_op"


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.default_generator.get_state()
    module: Any = torch.get_device_module(device.type)
    return module.get_rng_state(device)  # type: ignore[no-any-return]


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        module: Any = torch.get_device_module(device.type)
        module.set_rng_state(state, device)


def _initial_seed(device: torch.device) -> int:
    if device.type == "cpu":
        return torch.default_generator.initial_seed()
    module: Any = torch.get_device_module(device.type)
    return int(module.initial_seed())


def _as_bytes(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()  # type: ignore[no-any-return]


def _is_fresh(stream: _Stream, device: torch.device, seed: int, state_bytes: bytes) -> bool:
    """Whether ``state_bytes`` is the state of a generator just seeded with ``seed``."""
    fresh = stream.fresh.get(seed)
    if fresh is None:
        if len(stream.fresh) > 64:
            stream.fresh.clear()
        generator = torch.Generator(device=device).manual_seed(seed)
        fresh = stream.fresh[seed] = _as_bytes(generator.get_state())
    return state_bytes == fresh


def _reseeded(stream: _Stream, device: torch.device, state_bytes: bytes) -> bool:
    """Whether the generator was seeded since the last DTensor random op (as far as it shows)."""
    seed = _initial_seed(device)
    return seed != stream.seed or _is_fresh(stream, device, seed, state_bytes)


def _fingerprint(state: torch.Tensor) -> int:
    """A 63-bit digest of a generator state, the same in every process (equal states, equal digests)."""
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _states_differ(state: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> bool:
    """Whether any two ranks along ``axes`` hold different states (the same answer on each)."""
    mine = _fingerprint(state)
    wire = get_platform().device_for(mesh.device_type)
    pair = torch.tensor([mine, -mine], dtype=torch.int64, device=wire)
    highest = collectives.all_reduce_over(pair, mesh, axes, "max").tolist()
    return bool(highest[0] != -highest[1])


def _take_first_state(
    state: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int], device: torch.device
) -> torch.Tensor:
    """The state of the first rank along ``axes`` (one broadcast each), warning where it differs."""
    wire = get_platform().device_for(mesh.device_type)
    received = state.to(wire)
    for axis in axes:
        received = collectives.broadcast(received, mesh, axis, 0)
    received = received.cpu()
    if torch.equal(received, state):
        return state
    coordinate = list(mesh.get_coordinate() or [])
    for axis in axes:
        coordinate[axis] = 0
    first = int(mesh.mesh[tuple(coordinate)].item())
    warnings.warn(
        f"hyper_parallel.dtensor: rank {mesh.get_rank()}'s default {device.type} generator "
        f"differed from rank {first}'s; DTensor random ops on {mesh} now draw from rank "
        f"{first}'s state, so replicas agree. Seed every rank with the same "
        "torch.manual_seed(...), or call hyper_parallel.dtensor.manual_seed(seed, mesh) "
        "to keep per-rank seeds on purpose",
        RandomSeedWarning,
        stacklevel=7,
    )
    return received


def _warn_moved(stream: _Stream, mesh: DeviceMesh, device: torch.device) -> None:
    if stream.warned_moved:
        return
    stream.warned_moved = True
    warnings.warn(
        f"hyper_parallel.dtensor: rank {mesh.get_rank()}'s default {device.type} generator "
        "moved between DTensor random ops without a reseed (plain random draws on this "
        f"rank); the op on {mesh} drew from the stream the last DTensor random op left, so "
        "replicas agree whichever ranks drew, and the generator continues from there. Draw "
        "per-rank numbers from a torch.Generator, or call torch.manual_seed(...) on every "
        "rank after such draws to take the one-device numbers from the new seed",
        RandomSeedWarning,
        stacklevel=6,
    )


def _start_state(
    stream: _Stream, device: torch.device, state: torch.Tensor, state_bytes: bytes, every_op: bool
) -> tuple[torch.Tensor, bool]:
    """The state to draw from, by what this rank knows, and whether it replaces a moved one."""
    if every_op or stream.last is None:
        return state, False
    if _reseeded(stream, device, state_bytes):  # before the known states: a reseed may repeat one
        stream.epoch += 1
        return state, False
    if state_bytes == stream.last_bytes:
        return state, False
    key = _state_key(state_bytes)
    if key in stream.known:  # e.g. activation checkpointing's replay
        stream.known.move_to_end(key)
        use = stream.known[key]
        return (state if use is None else use), False
    return stream.last, True


def _read(device: torch.device) -> tuple[torch.Tensor, bytes, int]:
    """The default generator's state (as a tensor and as bytes) and its seed."""
    if device.type == "cpu":
        generator = torch.default_generator
        state = generator.get_state()
        return state, state.numpy().tobytes(), generator.initial_seed()
    state = _generator_state(device)
    return state, state.numpy().tobytes(), _initial_seed(device)


def _begin(mesh: DeviceMesh, device: torch.device, replicated: Iterable[int]) -> _Stream | None:
    """Put the state this rank must draw from in its default generator (maybe a collective)."""
    if _seed_sync.trusted or device.type == "meta":
        return None
    if mesh.get_coordinate() is None:
        return None
    stream = _seed_sync.streams.get(device.type)
    if stream is None:
        stream = _seed_sync.streams[device.type] = _Stream()
    # read here, not in steady state (it costs as much as the steady state's comparison)
    every_op = stream.every_op = _check_every_op()
    state, state_bytes, _ = _read(device)
    use, moved = _start_state(stream, device, state, state_bytes, every_op)
    record = stream.meshes.get(mesh)
    sizes = [(axis, mesh.size(axis)) for axis in range(mesh.ndim)]
    if record is None:  # the mesh's first random op: sync every axis
        aligned: frozenset[int] = frozenset()
        axes = [axis for axis, size in sizes if size > 1]
    else:
        valid = record.epoch == stream.epoch and not every_op
        aligned = record.aligned if valid else frozenset()
        axes = [a for a in replicated if sizes[a][1] > 1 and a not in aligned]
    if axes and (record is None or _states_differ(use, mesh, axes)):
        replaced = _take_first_state(use, mesh, axes, device)
        moved = moved and replaced is use
        use = replaced
    if record is None or axes:
        now = aligned | frozenset(axes)
        complete = all(size == 1 or axis in now for axis, size in sizes)
        stream.meshes[mesh] = _MeshRecord(now, stream.epoch, complete)
    if moved:
        _warn_moved(stream, mesh, device)
    if use is not state:
        _set_generator_state(device, use)
        stream.remember(state_bytes, use)
    elif state_bytes != stream.last_bytes:
        stream.remember(state_bytes, None)
    return stream


class _AlignedDraw:
    """The context manager of :func:`aligned_generator` (the steady state inline: it is per op)."""

    __slots__ = ("_device", "_mesh", "_replicated", "_stream")

    def __init__(self, mesh: DeviceMesh, device: torch.device, replicated: Iterable[int]) -> None:
        self._mesh = mesh
        self._device = device
        self._replicated = replicated
        self._stream: _Stream | None = None

    def __enter__(self) -> None:
        device = self._device
        stream = _seed_sync.streams.get(device.type)
        if stream is not None and not _seed_sync.trusted:
            record = stream.meshes.get(self._mesh)  # a record: this rank is in the mesh
            if (
                record is not None
                and record.complete
                and record.epoch == stream.epoch
                and not (stream.every_op or stream.last_fresh)
            ):
                # the steady state: nothing moved the generator since the last op
                if device.type == "cpu":
                    generator = torch.default_generator
                    state_bytes = generator.get_state().numpy().tobytes()
                    seed = generator.initial_seed()
                else:
                    _, state_bytes, seed = _read(device)
                if state_bytes == stream.last_bytes and seed == stream.seed:
                    self._stream = stream
                    return
        self._stream = _begin(self._mesh, device, self._replicated)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # the draw's end state is the stream, known to be aligned
        stream = self._stream
        if stream is None:
            return
        device = self._device
        if device.type == "cpu":
            generator = torch.default_generator
            state = generator.get_state()
            seed = generator.initial_seed()
        else:
            state = _generator_state(device)
            seed = _initial_seed(device)
        state_bytes: bytes = state.numpy().tobytes()
        stream.last, stream.last_bytes, stream.seed = state, state_bytes, seed
        fresh = stream.fresh.get(seed)
        stream.last_fresh = (
            state_bytes == fresh
            if fresh is not None
            else _is_fresh(stream, device, seed, state_bytes)
        )
        stream.remember(state_bytes, None)


def aligned_generator(
    mesh: DeviceMesh, device: torch.device, replicated: Iterable[int]
) -> _AlignedDraw:
    """Around a random op on ``mesh``: the ranks along ``replicated`` axes draw from one state.

    ``replicated``: the mesh axes along which the op's result is replicated (its ranks
    must draw alike). Entering may run a collective over ``mesh`` (module docstring);
    leaving records the state the draw left. A user's ``generator=`` is not aligned (as
    torch): do not wrap such a draw. Raises ``ValueError`` on a bad
    ``HYPER_PARALLEL_RNG_CHECK`` before anything changes.

    Example::

        with aligned_generator(w.device_mesh, w.to_local().device, replicated=[1]):
            w.to_local().normal_()   # the draw
    """
    return _AlignedDraw(mesh, device, replicated)

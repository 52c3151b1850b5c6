"""Generator seeds of DTensor random ops: ranks that must draw alike hold one state.

A DTensor random op gives every rank its slice of one draw (``_ops/random.py``) from
torch's default generator, so ``torch.manual_seed(s)`` on every rank gives one device's
numbers and ``torch.utils.checkpoint`` replays them. That is one draw only while the
ranks' generators agree, which per-rank seeding (``torch.manual_seed(rank)``, a data
pipeline's ``base + dp_rank``) breaks at any time. :func:`set_random_sync` picks how
ranks agree, process-wide:

``"check"`` (the default), before each op:

- the first random op on each mesh (and device type) takes the state of the mesh's
  first rank: one broadcast per mesh axis;
- every later one whose result is replicated along some mesh axes checks that the
  ranks along them still agree (one all-reduce of a fingerprint of the state per
  axis) and, where they do not, takes the state of the first rank along them (one
  broadcast per axis).

``"stream"``: one agreed *stream* state per device type, collective-free after the
first op on each mesh:

- the first random op on each mesh broadcasts the first rank's stream (or, before any
  stream exists, its default generator's state) over every axis; the op draws from it;
- every later op runs no collective. When the default generator still holds the
  stream (nothing touched it since the last op) the op draws from it in place, exactly
  as one device; otherwise (a per-rank reseed, a plain draw of this rank's own) the op
  draws from the stream in a fork, leaving the user's generator as it was but for one
  *tick* draw, and remembers which stream state it drew from for that generator state;
- an activation-checkpoint recompute (inside the backward) finds the state its
  forward met in that memory, or, absent, draws in place as the forward did.

Whether a collective runs depends only on what every rank of the op's mesh shares (the
op, its placements, whether the mesh was used before), never on a generator's state.
Either way the ranks whose state was replaced get a :class:`RandomSeedWarning`.
:func:`manual_seed` is torch's: the caller vouches for the seeds (one per pipeline
stage, say), and no state is synced or checked from then on, in either mode.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import get_platform

__all__ = [
    "RandomSeedWarning",
    "RandomSync",
    "draw_aligned",
    "manual_seed",
    "set_random_sync",
]

T = TypeVar("T")

RandomSync = Literal["check", "stream"]
_MODES: tuple[RandomSync, ...] = ("check", "stream")
# forked ops remembered for activation-checkpoint replays, bounded by the bytes of the states
# they hold: a recompute finds its forward's entry if fewer forked ops ran in between
# (dropouts x layers x microbatches in flight). CPU states are 5 KB (12,800 entries), CUDA's
# 16 bytes (4M entries); the first entry dropped warns (RandomSeedWarning), once.
_REPLAY_BYTES = 64 * 2**20


class RandomSeedWarning(UserWarning):
    """This rank's generator differed from its mesh's first rank's: a DTensor random op took that one."""


@dataclass
class _Stream:
    """Stream mode's agreed state of one device type, and what it needs to replay forks."""

    state: torch.Tensor | None = None  # the state the last DTensor random op left
    state_bytes: bytes = b""
    meshes: set[DeviceMesh] = field(default_factory=set)  # first op done in stream mode
    # the default generator's state before a forked op (its digest) -> the state it drew from
    replay: OrderedDict[bytes, tuple[bytes, torch.Tensor]] = field(default_factory=OrderedDict)
    # how many entries of ``replay`` have each sketch: most lookups end here, without a digest
    sketches: dict[bytes, int] = field(default_factory=dict)
    dropped_any: bool = False  # an entry was dropped for room (warned once)

    def remember(self, before: bytes, drawn_from: torch.Tensor) -> None:
        key, sketch = _digest(before), _sketch(before)
        if key not in self.replay:
            self.sketches[sketch] = self.sketches.get(sketch, 0) + 1
        self.replay[key] = (sketch, drawn_from)
        self.replay.move_to_end(key)
        if len(self.replay) * (drawn_from.numel() * drawn_from.element_size()) > _REPLAY_BYTES:
            self._drop(next(iter(self.replay)))
            if not self.dropped_any:
                self.dropped_any = True
                warnings.warn(
                    f"hyper_parallel.dtensor: stream mode remembers the last {len(self.replay)} "
                    "DTensor random ops that drew apart from this rank's generator (it was "
                    "reseeded per rank or drew on its own); an activation-checkpoint recompute "
                    "of an older one would draw other numbers than its forward. Seed every rank "
                    "alike (then no op forks), or use manual_seed(seed, mesh) or "
                    'set_random_sync("check")',
                    RandomSeedWarning,
                    stacklevel=5,
                )

    def recorded(self, before: bytes) -> torch.Tensor | None:
        """The state a forked op met at ``before`` drew from, if remembered."""
        if _sketch(before) not in self.sketches:
            return None
        entry = self.replay.get(_digest(before))
        return None if entry is None else entry[1]

    def forget(self, before: bytes) -> None:
        """An op drew in place at ``before``: a replay must draw in place there too."""
        if _sketch(before) in self.sketches:
            key = _digest(before)
            if key in self.replay:
                self._drop(key)

    def _drop(self, key: bytes) -> None:
        sketch, _ = self.replay.pop(key)
        if self.sketches[sketch] == 1:
            del self.sketches[sketch]
        else:
            self.sketches[sketch] -= 1


class _SeedSync:
    """The mode; per mode, what was synced; whether the caller vouches for the seeds."""

    def __init__(self) -> None:
        self.mode: RandomSync = "check"
        self.synced: set[tuple[DeviceMesh, str]] = set()  # check mode's first syncs
        self.streams: dict[str, _Stream] = {}  # stream mode, per device type
        self.trusted = False


_seed_sync = _SeedSync()


def set_random_sync(mode: RandomSync) -> RandomSync:
    """Choose how DTensor random ops keep replicas equal, process-wide; returns the previous mode.

    ``"check"`` (the default): the first op on a mesh syncs the ranks' default
    generators; each later op with replicated results checks them (one small all-reduce)
    and re-syncs a split, so ``torch.manual_seed`` with one seed on every rank steers the
    draws at any time. ``"stream"``: after the first op on each mesh, no collective at
    all; ops draw from one agreed stream whatever each rank's generator did, so a
    ``torch.manual_seed`` after that first op no longer steers them (use
    :func:`manual_seed`). Call it on every rank alike, like ``torch.manual_seed``.
    Changing the mode forgets stream mode's state: the next stream op on each mesh syncs.

    Example::

        previous = set_random_sync("stream")
        torch.manual_seed(0)
        model.init_weights()        # one device's values, first op per mesh syncs
        ...                         # dropout: no collective, whatever each rank's seed
        set_random_sync(previous)
    """
    if mode not in _MODES:
        raise ValueError(f"set_random_sync: expected one of {list(_MODES)}, found {mode!r}")
    previous = _seed_sync.mode
    if mode != previous:
        _seed_sync.streams.clear()
        _seed_sync.mode = mode
    return previous


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed this rank's default generator; DTensor random ops then trust it (no sync, no check).

    torch's ``torch.distributed.tensor._random.manual_seed``: the caller vouches that
    the ranks that should draw alike got the same ``seed`` (e.g. one seed per pipeline
    stage), so random ops skip the agreement check and its collective, in either mode
    of :func:`set_random_sync`. Raises ``RuntimeError`` on a rank outside
    ``device_mesh``, as torch.

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


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.default_generator.get_state()
    module: Any = torch.get_device_module(device.type)
    return module.get_rng_state(device)  # type: ignore[no-any-return]


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.default_generator.set_state(state)
    else:
        module: Any = torch.get_device_module(device.type)
        module.set_rng_state(state, device)


def _as_bytes(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()  # type: ignore[no-any-return]


def _digest(state_bytes: bytes) -> bytes:
    """A 16-byte digest of a generator state's bytes (equal states, equal digests)."""
    return hashlib.blake2b(state_bytes, digest_size=16).digest()


def _sketch(state_bytes: bytes) -> bytes:
    """A cheap part of a generator state's bytes (equal states, equal sketches).

    Its first and last 64 bytes: for torch's CPU generator the seed, the position in the
    Mersenne twister's block and its first words, and the cached normal samples; all of
    a CUDA generator's 16. States that differ almost always differ here.
    """
    return state_bytes[:64] + state_bytes[-64:]


def _fingerprint(state: torch.Tensor) -> int:
    """A 63-bit digest of a generator state (equal states, equal digests)."""
    digest = hashlib.blake2b(_as_bytes(state), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _states_differ(state: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> bool:
    """Whether any two ranks along ``axes`` hold different states (the same answer on each)."""
    mine = _fingerprint(state)
    wire = get_platform().device_for(mesh.device_type)
    pair = torch.tensor([mine, -mine], dtype=torch.int64, device=wire)
    highest = collectives.all_reduce_over(pair, mesh, axes, "max").tolist()
    return bool(highest[0] != -highest[1])


def _first_rank_state(
    state: torch.Tensor,
    mesh: DeviceMesh,
    axes: Sequence[int],
    device: torch.device,
    what: str = "default {} generator",
) -> torch.Tensor:
    """The state of the first rank along ``axes`` (one broadcast each), warning where it differs.

    ``what`` names ``state`` in the warning (``{}``: the device type).
    """
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
        f"hyper_parallel.dtensor: rank {mesh.get_rank()}'s {what.format(device.type)} "
        f"differed from rank {first}'s; DTensor random ops on {mesh} now draw from rank "
        f"{first}'s state, so replicas agree. Seed every rank with the same "
        "torch.manual_seed(...), or call hyper_parallel.dtensor.manual_seed(seed, mesh) "
        "to keep per-rank seeds on purpose",
        RandomSeedWarning,
        stacklevel=7,
    )
    return received


def _align_generators(mesh: DeviceMesh, device: torch.device, replicated: Iterable[int]) -> None:
    """Check mode, before a random op: the ranks along ``replicated`` axes hold one state."""
    key = (mesh, device.type)
    first_use = key not in _seed_sync.synced
    _seed_sync.synced.add(key)
    axes = [a for a in (range(mesh.ndim) if first_use else replicated) if mesh.size(a) > 1]
    if not axes:
        return
    state = _generator_state(device)
    # after the first sync a check is cheaper than a broadcast, and almost always passes
    if first_use or _states_differ(state, mesh, axes):
        received = _first_rank_state(state, mesh, axes, device)
        if received is not state:
            _set_generator_state(device, received)


def _recomputing() -> bool:
    """Whether this op runs inside a backward (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


def _tick(device: torch.device) -> None:
    """Advance the default generator by one small draw (forked ops leave distinct states)."""
    torch.empty(1, device=device).uniform_()


def _forked(
    device: torch.device, before: torch.Tensor, source: torch.Tensor, draw: Callable[[], T]
) -> tuple[T, torch.Tensor]:
    """``draw`` from ``source``; the default generator is then ``before`` advanced by a tick."""
    _set_generator_state(device, source)
    try:
        result = draw()
        after = _generator_state(device)
    finally:
        _set_generator_state(device, before)
    _tick(device)
    return result, after


def _draw_from_stream(mesh: DeviceMesh, device: torch.device, draw: Callable[[], T]) -> T:
    """Stream mode: ``draw`` from the agreed stream (a collective only on the mesh's first op)."""
    stream = _seed_sync.streams.get(device.type)
    if stream is None:
        stream = _seed_sync.streams[device.type] = _Stream()
    before = _generator_state(device)
    before_bytes: bytes = before.numpy().tobytes()
    known = mesh in stream.meshes
    if known and before_bytes == stream.state_bytes and not _recomputing():
        # the steady state: nothing touched the generator since the last op; one device's draw
        stream.forget(before_bytes)
        result = draw()
        after = _generator_state(device)
        stream.state, stream.state_bytes = after, after.numpy().tobytes()
        return result
    if known and _recomputing():
        # the forward forked from this generator state, or drew in place from it
        recorded = stream.recorded(before_bytes)
        return draw() if recorded is None else _forked(device, before, recorded, draw)[0]
    if known:
        assert stream.state is not None  # set by the mesh's first op
        source, source_bytes = stream.state, stream.state_bytes
    else:
        axes = [axis for axis in range(mesh.ndim) if mesh.size(axis) > 1]
        if stream.state is None:
            mine, what = before, "default {} generator"
        else:  # a mesh used later must not reset the stream other meshes rely on
            mine, what = stream.state, "DTensor random stream ({})"
        source = _first_rank_state(mine, mesh, axes, device, what) if axes else mine
        source_bytes = _as_bytes(source)
        stream.meshes.add(mesh)
        stream.state, stream.state_bytes = source, source_bytes
    if source_bytes == before_bytes:
        stream.forget(before_bytes)
        result = draw()
        after = _generator_state(device)
    else:
        result, after = _forked(device, before, source, draw)
        stream.remember(before_bytes, source)
    stream.state, stream.state_bytes = after, _as_bytes(after)
    return result


def draw_aligned(
    mesh: DeviceMesh, device: torch.device, replicated: Iterable[int], draw: Callable[[], T]
) -> T:
    """Run ``draw`` (a random op on ``mesh`` drawing from the default generator) so replicas agree.

    ``replicated``: the mesh axes along which the op's result is replicated (its ranks
    must draw alike). Per :func:`set_random_sync`'s mode: ``"check"`` aligns the ranks'
    generators first (the first op on a mesh syncs every axis; later ones check the
    replicated axes), ``"stream"`` draws from the agreed stream (a collective on the
    mesh's first op only). Trusted seeds (:func:`manual_seed`), meta tensors and ranks
    off the mesh draw as they stand.

    Example::

        draw_aligned(w.device_mesh, w.to_local().device, [1], lambda: fill(w))
    """
    if _seed_sync.trusted or device.type == "meta" or mesh.get_coordinate() is None:
        return draw()
    if _seed_sync.mode == "check":
        _align_generators(mesh, device, replicated)
        return draw()
    return _draw_from_stream(mesh, device, draw)

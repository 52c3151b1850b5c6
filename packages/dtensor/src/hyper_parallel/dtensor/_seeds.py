"""Generator seeds of DTensor random ops: ranks that must draw alike hold one state.

A DTensor random op gives every rank its slice of one draw (``_ops/random.py``) from
torch's default generator, so ``torch.manual_seed(s)`` on every rank gives one device's
numbers and ``torch.utils.checkpoint`` replays them. That is one draw only while the
ranks' generators agree, which per-rank seeding (``torch.manual_seed(rank)``, a data
pipeline's ``base + dp_rank``) breaks at any time. So, before it draws:

- the first random op on each mesh (and device type) takes the state of the mesh's
  first rank: one broadcast per mesh axis;
- every later one whose result is replicated along some mesh axes checks that the
  ranks along those axes still agree (one all-reduce of a fingerprint of the state per
  axis) and, where they do not, takes the state of the first rank along them (one
  broadcast per axis).

Either way the ranks whose state was replaced get a :class:`RandomSeedWarning`.
Replicas therefore agree whatever each rank's seed, and whenever the seeds agree every
shard is its slice of the one-device draw. :func:`manual_seed` is torch's: the caller
vouches for the seeds (one per pipeline stage, say), and no state is synced or checked
from then on.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import get_platform

__all__ = ["RandomSeedWarning", "align_generators", "manual_seed"]


class RandomSeedWarning(UserWarning):
    """This rank's generator differed from its mesh's first rank's: a DTensor random op took that one."""


class _SeedSync:
    """Which (mesh, device type) pairs have had their first sync, and whether the caller vouches."""

    def __init__(self) -> None:
        self.synced: set[tuple[DeviceMesh, str]] = set()
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


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    module: Any = torch.get_device_module(device.type)
    return module.get_rng_state(device)  # type: ignore[no-any-return]


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        module: Any = torch.get_device_module(device.type)
        module.set_rng_state(state, device)


def _fingerprint(state: torch.Tensor) -> int:
    """A 63-bit digest of a generator state (equal states, equal digests)."""
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
) -> None:
    """Give every rank the state of the first rank along ``axes``, warning where it changed."""
    wire = get_platform().device_for(mesh.device_type)
    received = state.to(wire)
    for axis in axes:
        received = collectives.broadcast(received, mesh, axis, 0)
    received = received.cpu()
    if torch.equal(received, state):
        return
    _set_generator_state(device, received)
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
        stacklevel=6,
    )


def align_generators(mesh: DeviceMesh, device: torch.device, replicated: Sequence[int]) -> None:
    """Before a random op on ``mesh``: the ranks along ``replicated`` axes hold one generator state.

    ``replicated``: the mesh axes along which the op's result is replicated (its ranks
    must draw alike). The first op on a mesh syncs every axis. Collective over ``mesh``.

    Example::

        align_generators(w.device_mesh, w.to_local().device, replicated=[1])   # then draw
    """
    if _seed_sync.trusted or device.type == "meta" or mesh.get_coordinate() is None:
        return
    key = (mesh, device.type)
    first_use = key not in _seed_sync.synced
    _seed_sync.synced.add(key)
    axes = [a for a in (range(mesh.ndim) if first_use else replicated) if mesh.size(a) > 1]
    if not axes:
        return
    state = _generator_state(device)
    # after the first sync a check is cheaper than a broadcast, and almost always passes
    if first_use or _states_differ(state, mesh, axes):
        _take_first_state(state, mesh, axes, device)

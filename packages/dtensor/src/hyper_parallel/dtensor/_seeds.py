"""Generator seeds of DTensor random ops: the state sync per mesh, and torch's ``manual_seed``.

A DTensor random op gives every rank its slice of one draw (``_ops/random.py``), which
is one device's draw only if every rank's default generator holds the same state.
As torch's DTensor does at its first random op, the first random op on each mesh (and
device type) takes the state of the mesh's first rank: one broadcast per mesh axis,
once per mesh. :func:`manual_seed` turns the sync off (the caller vouches for the seeds).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import get_platform

__all__ = ["RandomSeedWarning", "manual_seed", "sync_generator"]


class RandomSeedWarning(UserWarning):
    """This rank's generator differed from the mesh's first rank's: a DTensor random op took that one."""


class _SeedSync:
    """Which (mesh, device type) pairs have had their generator state synced, or whether none needs it."""

    def __init__(self) -> None:
        self.synced: set[tuple[DeviceMesh, str]] = set()
        self.trusted = False


_seed_sync = _SeedSync()


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed this rank's default generator; DTensor random ops then trust it (no state sync).

    torch's ``torch.distributed.tensor._random.manual_seed``: the caller vouches that
    the ranks that should draw alike got the same ``seed`` (e.g. one seed per pipeline
    stage). Raises ``RuntimeError`` on a rank outside ``device_mesh``, as torch.

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


def sync_generator(mesh: DeviceMesh, device: torch.device) -> None:
    """Give every rank of ``mesh`` the default generator state of its first rank (once per mesh).

    Example::

        sync_generator(w.device_mesh, w.to_local().device)   # before drawing w's values
    """
    key = (mesh, device.type)
    if _seed_sync.trusted or key in _seed_sync.synced or device.type == "meta":
        return
    _seed_sync.synced.add(key)
    if mesh.get_coordinate() is None:
        return
    mine = _generator_state(device)
    wire = get_platform().device_for(mesh.device_type)
    state = mine.to(wire)
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            state = collectives.broadcast(state, mesh, axis, 0)
    state = state.cpu()
    if not torch.equal(state, mine):
        _set_generator_state(device, state)
        first = int(mesh.mesh.reshape(-1)[0].item())
        warnings.warn(
            f"hyper_parallel.dtensor: rank {mesh.get_rank()}'s default {device.type} generator "
            f"differed from rank {first}'s; DTensor random ops on {mesh} now draw from rank "
            f"{first}'s state, so replicas agree (as torch's DTensor does). Seed every rank "
            "with the same torch.manual_seed(...), or call hyper_parallel.dtensor.manual_seed"
            "(seed, mesh) to keep per-rank seeds on purpose",
            RandomSeedWarning,
            stacklevel=6,
        )

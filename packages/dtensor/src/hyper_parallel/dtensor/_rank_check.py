"""Checking across ranks that every rank's piece belongs to one global tensor.

``DTensor.from_local(..., run_check=True)`` and ``distribute_tensor`` gather a small
record from every rank of the mesh (dtype, requires_grad, placements, shape) and
check it the same way on every rank, so a mismatch raises the same clear error
everywhere instead of a collective later aborting one rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._redistribute import PlacementError
from hyper_parallel.dtensor._spec import local_shape_and_offset
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    is_shard_like,
)
from hyper_parallel.platform import get_platform

__all__ = ["RankRecord", "check_distribute_inputs", "check_local_shards"]

_MAX_DIMS = 64
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_REDUCE_OPS = ("sum", "avg", "product", "max", "min")


class RankRecord:
    """What one rank holds: dtype, requires_grad, placements and a shape."""

    __slots__ = ("dtype", "placements", "requires_grad", "shape")

    def __init__(
        self,
        dtype: torch.dtype,
        requires_grad: bool,
        placements: tuple[Placement, ...],
        shape: tuple[int, ...],
    ) -> None:
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.placements = placements
        self.shape = shape


def _encode(record: RankRecord, mesh_ndim: int) -> torch.Tensor:
    if len(record.shape) > _MAX_DIMS:
        raise PlacementError(
            f"tensors of more than {_MAX_DIMS} dims cannot be checked across ranks"
        )
    values = [_DTYPES.index(record.dtype), int(record.requires_grad), len(record.shape)]
    for p in record.placements:
        if isinstance(p, Shard):
            values += [1, p.dim]
        elif isinstance(p, Partial):
            values += [2, _REDUCE_OPS.index(p.reduce_op)]
        elif isinstance(p, _StridedShard):  # dim and split factor in one int
            values += [3, p.dim + _STRIDED_BASE * p.split_factor]
        else:
            values += [0, 0]
    values += [*record.shape, *([-1] * (_MAX_DIMS - len(record.shape)))]
    return torch.tensor(values, dtype=torch.int64)


_STRIDED_BASE = 1 << 16  # above any tensor dim


def _decode(row: list[int], mesh_ndim: int) -> RankRecord:
    placements: list[Placement] = []
    for axis in range(mesh_ndim):
        kind, value = row[3 + 2 * axis], row[4 + 2 * axis]
        if kind == 1:
            placements.append(Shard(value))
        elif kind == 2:
            placements.append(Partial(_REDUCE_OPS[value]))  # type: ignore[arg-type]
        elif kind == 3:
            placements.append(_StridedShard(value % _STRIDED_BASE, sf=value // _STRIDED_BASE))
        else:
            placements.append(Replicate())
    start = 3 + 2 * mesh_ndim
    shape = tuple(row[start : start + row[2]])
    return RankRecord(_DTYPES[row[0]], bool(row[1]), tuple(placements), shape)


def gather_records(
    record: RankRecord, mesh: DeviceMesh, device: torch.device
) -> dict[tuple[int, ...], RankRecord]:
    """Every mesh coordinate's record, on every rank of the mesh (one all-gather per axis)."""
    # built on CPU even under ``with torch.device("meta"):`` (a model built on meta)
    with torch.device("cpu"):
        return _gather_records(record, mesh, device)


def _gather_records(
    record: RankRecord, mesh: DeviceMesh, device: torch.device
) -> dict[tuple[int, ...], RankRecord]:
    stacked = _encode(record, mesh.ndim).to(device)
    for axis in reversed(range(mesh.ndim)):
        if mesh.size(axis) > 1:
            stacked = collectives.all_gather(stacked, mesh, axis)
        else:
            stacked = stacked.unsqueeze(0)
    rows = stacked.reshape(-1, stacked.shape[-1]).cpu().tolist()
    coordinates = [
        tuple(int(i) for i in c)
        for c in torch.cartesian_prod(*[torch.arange(n) for n in mesh.shape])
        .reshape(len(rows), -1)
        .tolist()
    ]
    return {c: _decode(row, mesh.ndim) for c, row in zip(coordinates, rows, strict=True)}


def _rank_of(mesh: DeviceMesh, coordinate: Sequence[int]) -> int:
    return int(mesh.mesh[tuple(coordinate)].item())


def _first_mismatch(
    records: dict[tuple[int, ...], RankRecord], mesh: DeviceMesh, what: str, field: str
) -> str | None:
    first_coord, first = next(iter(records.items()))
    for coordinate, record in records.items():
        if getattr(record, field) != getattr(first, field):
            return (
                f"{what}: the ranks disagree on the {field.replace('_', ' ')}: rank "
                f"{_rank_of(mesh, first_coord)} has {getattr(first, field)}, rank "
                f"{_rank_of(mesh, coordinate)} (mesh coordinate {list(coordinate)}) has "
                f"{getattr(record, field)}"
            )
    return None


def check_local_shards(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """The global shape the shards of every rank form; the same error on every rank if none.

    Every rank must hold the same dtype, requires_grad, placements and number of dims;
    every dim that no mesh axis shards must have one size everywhere; the shard sizes
    must follow ``torch.chunk`` of the global size (``shape`` when given, else the sum
    of the shards). Collective over the mesh.
    """
    what = "DTensor.from_local(run_check=True)"
    mine = RankRecord(local.dtype, local.requires_grad, placements, tuple(local.shape))
    records = gather_records(mine, mesh, local.device)
    for field in ("dtype", "requires_grad", "placements"):
        problem = _first_mismatch(records, mesh, what, field)
        if problem:
            raise PlacementError(problem)
    ndims = {len(r.shape) for r in records.values()}
    if len(ndims) > 1:
        raise PlacementError(_first_mismatch(records, mesh, what, "shape") or what)
    origin = tuple(0 for _ in mesh.shape)
    first = records[origin]
    sharded = {p.dim for p in placements if is_shard_like(p)}  # type: ignore[attr-defined]
    for coordinate, record in records.items():
        for dim, size in enumerate(record.shape):
            if dim not in sharded and shape is None and size != first.shape[dim]:
                raise PlacementError(
                    f"{what}: dim {dim}, which no mesh axis shards (placements {placements}), "
                    f"must have one size on every rank: rank {_rank_of(mesh, origin)} has "
                    f"{first.shape[dim]}, rank {_rank_of(mesh, coordinate)} (mesh coordinate "
                    f"{list(coordinate)}) has {size}"
                )
    if shape is None:
        sizes = list(records[origin].shape)
        for dim in range(len(sizes)):
            axes = [a for a, p in enumerate(placements) if is_shard_like(p) and p.dim == dim]  # type: ignore[attr-defined]
            if axes:
                sizes[dim] = sum(
                    r.shape[dim]
                    for c, r in records.items()
                    if all(c[a] == 0 for a in range(mesh.ndim) if a not in axes)
                )
        global_shape = tuple(sizes)
    else:
        global_shape = shape
    for coordinate, record in records.items():
        expected, _ = local_shape_and_offset(global_shape, mesh.shape, coordinate, placements)
        if record.shape != expected:
            raise PlacementError(
                f"{what}: with placements {placements} the shards form global shape "
                f"{global_shape}, so rank {_rank_of(mesh, coordinate)} (mesh coordinate "
                f"{list(coordinate)}) must hold a shard of shape {expected} (torch.chunk "
                f"layout; dims no mesh axis shards are the same on every rank), found "
                f"{record.shape}"
            )
    return global_shape


def check_distribute_inputs(tensor: torch.Tensor, mesh: DeviceMesh) -> None:
    """Raise the same error on every rank unless every rank passes one shape and dtype."""
    what = "distribute_tensor"
    placeholder = (Replicate(),) * mesh.ndim
    mine = RankRecord(tensor.dtype, False, placeholder, tuple(tensor.shape))
    device = tensor.device
    if device.type == "meta" or device.type != mesh.device_type:
        device = get_platform().device_for(mesh.device_type)  # a meta tensor's record travels too
    records = gather_records(mine, mesh, device)
    for field in ("dtype", "shape"):
        problem = _first_mismatch(records, mesh, what, field)
        if problem:
            raise PlacementError(
                problem + "; every rank must pass the same full tensor's shape and dtype"
            )

"""Moving a local shard from one set of placements to another with the cheapest collectives.

Per mesh axis: S->R all-gather, P->R all-reduce, P->S reduce-scatter, S(i)->S(j)
all-to-all, R->S a local slice. Uneven and empty shards follow ``torch.chunk``:
shards are padded to the largest chunk for the collective and trimmed after. A
``_StridedShard`` moves like a Shard whose chunk is a set of positions: gathered by one
all-gather put back in order, reached from Replicate by a local selection.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    chunk_bounds,
    local_shape_and_offset,
    strided_positions,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

__all__ = [
    "PlacementError",
    "check_redistribute_target",
    "pad_dim",
    "partition_replicated",
    "redistribute_local",
]


def check_redistribute_target(
    src: Sequence[Placement], dst: Sequence[Placement], *, where: str
) -> None:
    """Raise unless every target placement is reachable by ``redistribute`` (torch's rule).

    A Partial target is reachable only unchanged or from a Shard (as ``Partial("sum")``:
    each rank holds its shard in place and zeros elsewhere). The error is a
    ``RuntimeError`` like torch's (and a ``ValueError``, as before).
    """
    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if (
            isinstance(d, Partial)
            and s != d
            and not (isinstance(s, Shard) and d.reduce_op == "sum")
        ):
            raise PlacementError(
                f"{where}: mesh axis {axis}: cannot redistribute {s!r} to {d!r}; only Shard -> "
                "Partial('sum') reaches a Partial (a Partial value otherwise only arises from "
                "computation). Use Replicate() or Shard(dim) as the target."
            )


class PlacementError(ValueError, RuntimeError):
    """A layout that cannot be reached or kept; a ``RuntimeError`` where torch raises one."""


def pad_dim(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` padded with zeros along ``dim`` to ``length`` (``t`` itself when long enough)."""
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def _stacked_to_dim(stacked: torch.Tensor, dim: int, bounds: Sequence[int]) -> torch.Tensor:
    """Concatenate the ``n`` padded chunks of ``stacked`` (shape ``(n, ...)``) along ``dim``."""
    n = stacked.shape[0]
    full = bounds[1] - bounds[0]
    if bounds[-1] == full * n:
        if dim == 0:
            return stacked.reshape((n * stacked.shape[1], *stacked.shape[2:]))
        moved = stacked.movedim(0, dim)
        shape = list(moved.shape)
        shape[dim : dim + 2] = [shape[dim] * shape[dim + 1]]
        return moved.reshape(shape)
    pieces = [stacked[r].narrow(dim, 0, bounds[r + 1] - bounds[r]) for r in range(n)]
    return torch.cat(pieces, dim=dim)


def _split_to_stacked(t: torch.Tensor, dim: int, bounds: Sequence[int]) -> torch.Tensor:
    """Split ``t`` along ``dim`` into ``torch.chunk`` pieces, padded and stacked to ``(n, ...)``."""
    n = len(bounds) - 1
    full = bounds[1] - bounds[0]
    if bounds[-1] == full * n:
        shape = list(t.shape)
        shape[dim : dim + 1] = [n, full]
        return t.reshape(shape).movedim(dim, 0) if full > 0 else t.new_zeros([n, *t.shape])
    pieces = [
        pad_dim(t.narrow(dim, bounds[r], bounds[r + 1] - bounds[r]), dim, full) for r in range(n)
    ]
    return torch.stack(pieces, dim=0)


def _slice(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def _dim_size_at_axis(
    spec_shape: Sequence[int],
    mesh: DeviceMesh,
    coordinate: Sequence[int],
    current: Sequence[Placement],
    axis: int,
    dim: int,
) -> int:
    """Size of tensor dim ``dim`` that mesh axis ``axis`` splits (after the outer axes split it)."""
    outer = [p if i < axis else Replicate() for i, p in enumerate(current)]
    shape, _ = local_shape_and_offset(spec_shape, mesh.shape, coordinate, outer)
    return shape[dim]


def _shards_dim(p: Placement, dim: int) -> bool:
    return isinstance(p, (Shard, _StridedShard)) and p.dim == dim


def _gather_set(
    src: Sequence[Placement], dst: Sequence[Placement], use_all_to_all: set[int]
) -> set[int]:
    """Mesh axes whose shard must be all-gathered (inner nested shards of a moving dim too)."""
    gather: set[int] = set()
    for i, s in enumerate(src):
        if not isinstance(s, (Shard, _StridedShard)) or i in use_all_to_all:
            continue
        if dst[i] != s:
            gather.add(i)
            continue
        for k in range(i):
            outer_moves = _shards_dim(src[k], s.dim) and k in gather
            outer_new = _shards_dim(dst[k], s.dim) and src[k] != dst[k]
            if outer_moves or outer_new:
                gather.add(i)
                break
    return gather


def _is_lone_shard(dim: int, axis: int, src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """True when no mesh axis but ``axis`` shards tensor dim ``dim`` before or after."""
    return not any(
        _shards_dim(p, dim)
        for placements in (src, dst)
        for i, p in enumerate(placements)
        if i != axis
    )


@functools.lru_cache(maxsize=4096)
def _program(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> tuple[tuple[Placement, ...], frozenset[int], frozenset[int], frozenset[int]] | None:
    """What a move from ``src`` to ``dst`` does, decided once per layout pair and mesh shape.

    ``(src relabelled, all-to-all axes, all-gather axes, shard -> Partial("sum") axes)``;
    ``None`` when nothing moves. Any target is reachable: a Partial one by partitioning
    the replicated value (the public API restricts that: :func:`check_redistribute_target`).
    """
    # Along a mesh axis of one rank every placement holds the same local values: relabel.
    src = tuple(
        d if mesh_shape[axis] == 1 else s for axis, (s, d) in enumerate(zip(src, dst, strict=True))
    )
    if src == dst:
        return None
    all_to_all_axes: set[int] = set()
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if (
            isinstance(s, Shard)
            and isinstance(d, Shard)
            and s.dim != d.dim
            and _is_lone_shard(s.dim, i, src, dst)
            and _is_lone_shard(d.dim, i, src, dst)
        ):
            all_to_all_axes.add(i)
    # S -> Partial("sum") of a lone shard: the shard in place, zeros elsewhere (no collective).
    to_partial = {
        i
        for i, (s, d) in enumerate(zip(src, dst, strict=True))
        if isinstance(s, Shard)
        and isinstance(d, Partial)
        and d.reduce_op == "sum"
        and _is_lone_shard(s.dim, i, src, dst)
    }
    gather = _gather_set(src, dst, all_to_all_axes | to_partial)
    return src, frozenset(all_to_all_axes), frozenset(gather), frozenset(to_partial)


def redistribute_local(
    local: torch.Tensor, spec: DTensorSpec, dst: tuple[Placement, ...], *, async_op: bool = False
) -> torch.Tensor:
    """Return this rank's shard of ``spec``'s tensor laid out as ``dst`` (no autograd).

    ``async_op``: the collectives are issued without waiting; the result may be pending,
    waited for by the first op that reads it (a step that must read a previous step's
    result, such as trimming an uneven gather, waits there, as in torch).
    """
    if spec.placements == dst:
        return local
    mesh = spec.mesh
    program = _program(spec.placements, dst, mesh.shape)
    if program is None:
        return local
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return local
    src, all_to_all_axes, gather, to_partial = program
    global_shape = spec.shape
    current: list[Placement] = list(src)

    # 0. a lone shard becomes Partial("sum"): placed in a zero tensor of its parent's size.
    for axis in sorted(to_partial):
        p = current[axis]
        assert isinstance(p, Shard)
        n = mesh.size(axis)
        parent = _dim_size_at_axis(global_shape, mesh, coordinate, current, axis, p.dim)
        bounds = chunk_bounds(parent, n)
        r = mesh.get_local_rank(axis)
        shape = list(local.shape)
        shape[p.dim] = parent
        placed = local.new_zeros(shape)
        placed.narrow(p.dim, bounds[r], bounds[r + 1] - bounds[r]).copy_(local)
        local = placed
        current[axis] = dst[axis]

    # 1. all-gather, innermost axis first, so nested shards of one dim unwind in order.
    for axis in sorted(gather, reverse=True):
        p = current[axis]
        n = mesh.size(axis)
        parent = _dim_size_at_axis(global_shape, mesh, coordinate, current, axis, p.dim)  # type: ignore[attr-defined]
        if isinstance(p, _StridedShard):
            local = _gather_strided(local, p, parent, mesh, axis, async_op)
        else:
            assert isinstance(p, Shard)
            bounds = chunk_bounds(parent, n)
            padded = pad_dim(local, p.dim, bounds[1] - bounds[0])
            stacked = collectives.all_gather(padded, mesh, axis, async_op=async_op)
            local = _stacked_to_dim(stacked, p.dim, bounds)
        current[axis] = Replicate()

    # 2. reduce partial values: all-reduce, or reduce-scatter straight into a lone shard.
    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if not isinstance(s, Partial) or s == d or current[axis] == d:
            continue
        n = mesh.size(axis)
        if isinstance(d, Shard) and _is_lone_shard(d.dim, axis, current, dst):
            bounds = chunk_bounds(local.shape[d.dim], n)
            stacked = _split_to_stacked(local, d.dim, bounds)
            reduced = collectives.reduce_scatter(
                stacked, mesh, axis, s.reduce_op, async_op=async_op
            )
            r = mesh.get_local_rank(axis)
            local = reduced.narrow(d.dim, 0, bounds[r + 1] - bounds[r])
            if local.shape[d.dim] != reduced.shape[d.dim]:
                local = local.contiguous()
            current[axis] = d
        else:
            local = collectives.all_reduce(local, mesh, axis, s.reduce_op, async_op=async_op)
            current[axis] = Replicate()

    # 3. all-to-all between two lone shards of one axis.
    for axis in sorted(all_to_all_axes):
        s, d = current[axis], dst[axis]
        assert isinstance(s, Shard) and isinstance(d, Shard)
        n = mesh.size(axis)
        r = mesh.get_local_rank(axis)
        src_bounds = chunk_bounds(global_shape[s.dim], n)
        dst_bounds = chunk_bounds(global_shape[d.dim], n)
        padded = pad_dim(local, s.dim, src_bounds[1] - src_bounds[0])
        stacked = _split_to_stacked(padded, d.dim, dst_bounds)
        exchanged = collectives.all_to_all(stacked, mesh, axis, async_op=async_op)
        # slot j holds rank j's rows of dim s.dim (padded) for this rank's chunk of d.dim
        mine = dst_bounds[r + 1] - dst_bounds[r]
        exchanged = exchanged.narrow(d.dim + 1, 0, mine)
        local = _stacked_to_dim(exchanged, s.dim, src_bounds)
        current[axis] = d

    # 4. local slices, outermost axis first.
    for axis, d in enumerate(dst):
        if isinstance(d, _StridedShard) and current[axis] != d:
            assert current[axis] == Replicate(), (current, dst)
            positions = strided_positions(
                local.shape[d.dim], d.split_factor, mesh.size(axis), mesh.get_local_rank(axis)
            )
            index = torch.tensor(positions, dtype=torch.long, device=local.device)
            local = local.index_select(d.dim, index)
            current[axis] = d
        if isinstance(d, Shard) and current[axis] != d:
            assert current[axis] == Replicate(), (current, dst)
            n = mesh.size(axis)
            parent = local.shape[d.dim]
            r = mesh.get_local_rank(axis)
            bounds = chunk_bounds(parent, n)
            local = _slice(local, d.dim, bounds[r], bounds[r + 1] - bounds[r])
            current[axis] = d

    # 5. Replicate -> Partial (ops that write a Partial tensor, distribute_tensor): partition.
    for axis, d in enumerate(dst):
        if isinstance(d, Partial) and current[axis] != d:
            local = partition_replicated(local, d, mesh.get_local_rank(axis), mesh.size(axis))
            current[axis] = d
    return local


def _gather_strided(
    local: torch.Tensor,
    p: _StridedShard,
    parent: int,
    mesh: DeviceMesh,
    axis: int,
    async_op: bool,
) -> torch.Tensor:
    """All-gather the ``_StridedShard`` chunks of mesh axis ``axis``, put back in order.

    Chunks are padded to the longest for the collective; the gathered positions (rank
    0's, then rank 1's, ...) are then sorted back by one ``index_select``.
    """
    n = mesh.size(axis)
    held = [strided_positions(parent, p.split_factor, n, r) for r in range(n)]
    longest = max(len(h) for h in held)
    stacked = collectives.all_gather(pad_dim(local, p.dim, longest), mesh, axis, async_op=async_op)
    # position k of the parent sits at slot (r, i) of the stacked chunks: flat r * longest + i
    source = [0] * parent
    for r, positions in enumerate(held):
        for i, k in enumerate(positions):
            source[k] = r * longest + i
    flat = stacked.movedim(0, p.dim)
    shape = list(flat.shape)
    shape[p.dim : p.dim + 2] = [shape[p.dim] * shape[p.dim + 1]]
    flat = flat.reshape(shape)
    index = torch.tensor(source, dtype=torch.long, device=flat.device)
    return flat.index_select(p.dim, index)


def partition_replicated(
    local: torch.Tensor, partial: Partial, axis_rank: int, axis_size: int
) -> torch.Tensor:
    """This rank's part of a replicated value laid out as ``partial`` (torch's partition).

    Sum: the value over the axis size (exact for power-of-two sizes); integer sums keep
    the value on the axis's first rank and zeros elsewhere. Product: the value on the
    first rank, ones elsewhere. Avg, max, min: the value.

    Example::

        partition_replicated(torch.ones(2), Partial(), 0, 2)   # tensor([0.5, 0.5])
    """
    if partial.reduce_op == "product":
        return local.clone() if axis_rank == 0 else torch.ones_like(local)
    if partial.reduce_op != "sum":
        return local.clone()
    if local.is_floating_point() or local.is_complex():
        return local / axis_size
    return local.clone() if axis_rank == 0 else torch.zeros_like(local)

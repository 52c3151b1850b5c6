"""``distribute_tensor``: lay a full tensor out over a mesh, scattered from one rank or sliced locally."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
from hyper_parallel.dtensor._redistribute import pad_dim
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    chunk_bounds,
    contiguous_strides,
    local_shape_and_offset,
    local_shard,
    normalize_placements,
    replicate_all,
)
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["distribute_tensor"]


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay a full tensor out over ``device_mesh``: a leaf DTensor holding this rank's shard.

    With ``src_data_rank=k`` the values come from global rank ``k`` (scattered
    along sharded axes, broadcast along replicated ones); with ``None`` every rank
    slices its own copy, with no communication.

    Example::

        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor: the input is already a DTensor; use .redistribute()")
    if placements is None:
        placements = replicate_all(device_mesh.ndim)
    placements_t = normalize_placements(
        placements, device_mesh.ndim, tensor.ndim, where="distribute_tensor"
    )
    for axis, p in enumerate(placements_t):
        if isinstance(p, Partial):
            raise ValueError(
                f"distribute_tensor: mesh axis {axis}: cannot distribute into {p!r}; a full "
                "tensor is laid out with Shard(dim) or Replicate()"
            )
    world = device_mesh.mesh.flatten().tolist()
    if src_data_rank is not None and src_data_rank not in world:
        raise ValueError(
            f"distribute_tensor: src_data_rank={src_data_rank} is not a rank of the mesh "
            f"(ranks {world})"
        )
    meta = TensorMeta(tensor.shape, contiguous_strides(tensor.shape), tensor.dtype)
    spec = DTensorSpec(device_mesh, placements_t, meta)
    coordinate = device_mesh.get_coordinate()
    data = tensor.detach()
    if coordinate is None:
        local = data.new_empty(0)
    elif src_data_rank is None:
        local = local_shard(data, device_mesh.shape, coordinate, placements_t)
    else:
        local = _scatter_from(data, device_mesh, coordinate, placements_t, src_data_rank)
    result = DTensor(local, spec, requires_grad=tensor.requires_grad)
    ensure_leaf_grad_hook(result)
    return result


def _scatter_from(
    full: torch.Tensor,
    mesh: DeviceMesh,
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    src_rank: int,
) -> torch.Tensor:
    """Scatter/broadcast axis by axis from ``src_rank``'s copy of ``full``.

    After axis ``i``, every rank whose coordinates on the later axes equal the
    source's holds its piece; each axis's group then forwards it one step.
    """
    src_coord = [int(c) for c in (mesh.mesh == src_rank).nonzero()[0].tolist()]
    piece = full.contiguous()
    for axis, p in enumerate(placements):
        n = mesh.size(axis)
        if n == 1:
            continue
        if any(coordinate[j] != src_coord[j] for j in range(axis + 1, mesh.ndim)):
            continue  # this rank's group along `axis` holds no data yet; a later axis brings it
        root = src_coord[axis]
        r = coordinate[axis]
        outer = [q if j < axis else Replicate() for j, q in enumerate(placements)]
        shape, _ = local_shape_and_offset(full.shape, mesh.shape, coordinate, outer)
        if isinstance(p, Shard):
            bounds = chunk_bounds(shape[p.dim], n)
            full_len = bounds[1] - bounds[0]
            like_shape = list(shape)
            like_shape[p.dim] = full_len
            chunks = None
            if r == root:
                chunks = [
                    pad_dim(
                        piece.narrow(p.dim, bounds[k], bounds[k + 1] - bounds[k]), p.dim, full_len
                    ).contiguous()
                    for k in range(n)
                ]
            received = collectives.scatter(chunks, piece.new_empty(like_shape), mesh, axis, root)
            piece = received.narrow(p.dim, 0, bounds[r + 1] - bounds[r]).contiguous()
        else:
            buffer = piece if r == root else piece.new_empty(shape)
            piece = collectives.broadcast(buffer, mesh, axis, root)
    if piece.data_ptr() == full.data_ptr() or piece is full:
        piece = piece.clone()
    return piece

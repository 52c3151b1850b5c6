"""``distribute_tensor``: lay a full tensor out over a mesh, scattered from one rank or sliced locally."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
from hyper_parallel.dtensor._rank_check import check_distribute_inputs
from hyper_parallel.dtensor._redistribute import PlacementError, pad_dim, redistribute_local
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    chunk_bounds,
    contiguous_strides,
    local_shape_and_offset,
    local_shard,
    normalize_placements,
    partial_to_replicate,
    replicate_all,
    strided_positions,
)
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard, _StridedShard

__all__ = ["distribute_tensor"]


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay a full tensor out over ``device_mesh``: a leaf DTensor holding this rank's shard.

    As in torch, ``src_data_rank=k`` is a group rank on each mesh axis: the values come
    from the rank at mesh coordinate ``(k, ..., k)`` (scattered along Shard axes,
    broadcast along Replicate and Partial axes); every rank must pass a tensor of the
    same shape and dtype (checked: the same error on every rank otherwise). With
    ``None`` every rank slices its own copy, with no communication. A Partial axis
    holds the value split as torch splits it (``"sum"``: value / axis size). Ranks
    outside the mesh hold an empty local tensor. A meta (or fake) tensor gives a meta
    DTensor (shapes and dtypes checked, no values sent), as torch, so a model built on
    meta can be parallelized, then ``to_empty()``'d and initialised. ``device_mesh``
    defaults to the mesh of ``with mesh:``.

    Example::

        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor: the input is already a DTensor; use .redistribute()")
    if device_mesh is None:
        device_mesh = current_mesh("distribute_tensor")
    if placements is None:
        placements = replicate_all(device_mesh.ndim)
    placements_t = normalize_placements(
        placements, device_mesh.ndim, tensor.ndim, where="distribute_tensor"
    )
    if src_data_rank is not None:
        too_small = [
            (axis, n)
            for axis, n in enumerate(device_mesh.shape)
            if n > 1 and not 0 <= src_data_rank < n
        ]
        if too_small:
            axis, n = too_small[0]
            name = device_mesh.mesh_dim_names[axis] if device_mesh.mesh_dim_names else axis
            raise PlacementError(
                f"distribute_tensor: src_data_rank={src_data_rank} is a group rank on each "
                f"mesh axis (as in torch), but mesh axis {name!r} has {n} ranks; expected "
                f"0 <= src_data_rank < {n}, or None to slice every rank's own copy"
            )
    # the global tensor's own strides, as torch's (a transposed tensor stays transposed);
    # an expanded one's (stride 0) would make every in-place op on the result refuse to
    # write overlapping memory, which the shards, fresh copies, do not have
    stride = tensor.stride()
    if any(st == 0 and size > 1 for size, st in zip(tensor.shape, stride, strict=True)):
        stride = contiguous_strides(tensor.shape)
    meta = TensorMeta(tensor.shape, stride, tensor.dtype)
    spec = DTensorSpec(device_mesh, placements_t, meta)
    coordinate = device_mesh.get_coordinate()
    data = tensor.detach()
    # Partial axes are distributed as Replicate, then split (torch's partition).
    laid_out = partial_to_replicate(placements_t)
    no_data = _has_no_data(data)
    if coordinate is None:
        local = data.new_empty(0)
    elif src_data_rank is None:
        local = local_shard(data, device_mesh.shape, coordinate, laid_out)
    elif no_data:
        # meta/fake tensors (a model built on meta): shapes and dtypes are still checked
        # across ranks, but there are no values to send; each rank takes its shard's shape
        check_distribute_inputs(data, device_mesh)
        local = local_shard(data, device_mesh.shape, coordinate, laid_out)
    else:
        check_distribute_inputs(data, device_mesh)
        local = _scatter_from(data, device_mesh, coordinate, laid_out, src_data_rank)
    if coordinate is not None and laid_out != placements_t and not no_data:
        local = redistribute_local(local, spec.with_placements(laid_out), placements_t)
    result = DTensor(local, spec, requires_grad=tensor.requires_grad)
    ensure_leaf_grad_hook(result)
    return result


def _has_no_data(tensor: torch.Tensor) -> bool:
    """True for meta tensors and fake tensors (shapes without values)."""
    if tensor.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(tensor))


def _scatter_from(
    full: torch.Tensor,
    mesh: DeviceMesh,
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    src_group_rank: int,
) -> torch.Tensor:
    """Scatter/broadcast axis by axis from the copy of ``full`` at coordinate ``(k, ..., k)``.

    After axis ``i``, every rank whose coordinates on the later axes equal the
    source's holds its piece; each axis's group then forwards it one step.
    """
    src_coord = [src_group_rank if n > 1 else 0 for n in mesh.shape]
    piece = full.resolve_conj().resolve_neg().contiguous()
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
            if isinstance(p, _StridedShard):  # positions spread over the dim: select locally
                index = strided_positions(shape[p.dim], p.split_factor, n, r)
                piece = piece.index_select(p.dim, torch.tensor(index, device=piece.device))
    if piece.data_ptr() == full.data_ptr() or piece is full:
        piece = piece.clone()
    return piece

"""Ops handled as a whole call rather than shard by shard."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._dispatch import detach_alias
from hyper_parallel.dtensor._redistribute import PlacementError, redistribute_local
from hyper_parallel.dtensor._registry import register_special
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    partial_to_replicate,
    replicate_all,
)
from hyper_parallel.dtensor._tensor import DTensor, dispatch_by_rules
from hyper_parallel.dtensor.collectives import all_reduce_over

aten = torch.ops.aten


# the dispatcher runs this one inline (AccumulateGrad detaches every gradient it stores)
register_special(aten.detach.default)(detach_alias)


@register_special(aten._fused_sdp_choice.default)
def _sdp_choice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Which attention kernel to use depends on shapes and devices only: ask with local shards."""
    local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    local_kwargs = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    return func(*local, **local_kwargs)


@register_special(aten.copy_.default)
def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)`` keeps ``dst``'s layout, as in torch: ``src`` is redistributed to it.

    A plain ``src`` of the global shape is taken as the full value (``load_state_dict``
    of plain tensors): each rank copies its part.
    """
    dst, src = args[0], args[1]
    if not isinstance(dst, DTensor):
        return dispatch_by_rules(func, args, kwargs)
    spec = dst._spec
    if isinstance(src, DTensor):
        if src._spec.mesh != spec.mesh:
            raise PlacementError(
                f"copy_: the source lives on {src._spec.mesh}, the target on {spec.mesh}; "
                "copying between meshes is not supported"
            )
        if src._spec.shape != spec.shape:
            return dispatch_by_rules(func, args, kwargs)  # broadcasting: the rule
        value = redistribute_local(src._local_tensor, src._spec, spec.placements)
    elif isinstance(src, torch.Tensor) and src.ndim > 0 and tuple(src.shape) == spec.shape:
        replicated = spec.with_placements(replicate_all(spec.mesh.ndim))
        value = redistribute_local(src, replicated, spec.placements)
    else:
        return dispatch_by_rules(func, args, kwargs)
    if spec.mesh.get_coordinate() is not None:
        dst._local_tensor.copy_(value, *args[2:], **kwargs)
    return dst


@register_special(aten._local_scalar_dense.default)
def _item(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``.item()``: the value of the whole (one-element) tensor, the same on every rank."""
    x: DTensor = args[0]
    return func(redistribute_local(x._local_tensor, x._spec, replicate_all(x._spec.mesh.ndim)))


@register_special(aten.is_same_size.default)
def _is_same_size(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Global shapes compared: no communication."""
    return tuple(args[0].shape) == tuple(args[1].shape)


@register_special(aten.equal.default)
def _equal(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.equal``: shards compared in one layout, the verdicts combined over the mesh."""
    a, b = args[0], args[1]
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or a._spec.mesh != b._spec.mesh:
        return dispatch_by_rules(func, args, kwargs)  # the mixed-tensor/mesh error
    if a._spec.shape != b._spec.shape:
        return False
    mesh = a._spec.mesh
    if mesh.get_coordinate() is None:
        return True  # as torch: ranks outside the mesh hold nothing to compare
    target = partial_to_replicate(a._spec.placements)
    la = redistribute_local(a._local_tensor, a._spec, target)
    lb = redistribute_local(b._local_tensor, b._spec, target)
    mine = torch.tensor([1 if func(la, lb) else 0], dtype=torch.int64, device=la.device)
    axes = [axis for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    return bool(all_reduce_over(mine, mesh, axes, "min").item())


@register_special(aten.as_strided.default)
def _as_strided(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``as_strided`` as a view: of a replicated DTensor any view, of a sharded one the identity.

    Other views of a sharded tensor would cross shard boundaries: the fallback.
    """
    x = args[0]
    size, stride = tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    spec: DTensorSpec = x._spec
    local = x._local_tensor
    if size == spec.shape and stride == spec.tensor_meta.stride and not offset:
        return DTensor(local.as_strided(local.size(), local.stride(), local.storage_offset()), spec)
    if spec.is_replicated():
        meta = TensorMeta(size, stride, spec.tensor_meta.dtype)
        return DTensor(
            func(local, *args[1:], **kwargs), DTensorSpec(spec.mesh, spec.placements, meta)
        )
    return dispatch_by_rules(func, args, kwargs)


@register_special(aten.unbind.int)
def _unbind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``unbind`` along a sharded dim raises, as torch: each slice would need a redistribution."""
    x = args[0]
    spec: DTensorSpec = x._spec
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = dim + spec.ndim if dim < 0 else dim
    sharding = [axis for axis, p in enumerate(spec.placements) if p.is_shard(dim)]
    if sharding:
        raise RuntimeError(
            f"{func}: attempted to unbind along the sharded dimension {dim} (placements "
            f"{spec.placements}, mesh axis {sharding[0]}). It cannot be performed without "
            "redistribution, which is disallowed by the current operator (as in torch); "
            f"redistribute dim {dim} to Replicate() first"
        )
    return dispatch_by_rules(func, args, kwargs)


@register_special(aten.embedding_renorm_.default)
def _embedding_renorm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nn.Embedding(max_norm=...)``'s in-place renorm: on a replicated weight only, as torch.

    torch has no sharding rule for it and raises; renormalising a shard in place would
    need its rows' norms across shards, so a sharded (or Partial) weight raises too.
    """
    weight = args[0]
    spec: DTensorSpec = weight._spec
    if not spec.is_replicated():
        raise NotImplementedError(
            f"{func}: nn.Embedding(max_norm=...) renormalises the weight in place, which "
            f"hyper_parallel.dtensor (like torch) supports only on a Replicate() weight; this "
            f"weight has placements {spec.placements}. Drop max_norm, or replicate the weight"
        )
    return dispatch_by_rules(func, args, kwargs)

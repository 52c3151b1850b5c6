"""Ops handled as a whole call rather than shard by shard."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._dispatch import dispatch_by_rules
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._registry import register_special
from hyper_parallel.dtensor._spec import local_shard, replicate_all
from hyper_parallel.dtensor._tensor import DTensor

aten = torch.ops.aten


@register_special(aten.detach.default)
def _detach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DTensor:
    x: DTensor = args[0]
    return DTensor(x._local_tensor.detach(), x._spec)


@register_special(aten._fused_sdp_choice.default)
def _sdp_choice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Which attention kernel to use depends on shapes and devices only: ask with local shards."""
    local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
    local_kwargs = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in kwargs.items()}
    return func(*local, **local_kwargs)


@register_special(aten.copy_.default)
def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """copy_ from a plain tensor of the global shape takes this rank's slice (load_state_dict)."""
    dst, src = args[0], args[1]
    plain_full = (
        isinstance(dst, DTensor)
        and isinstance(src, torch.Tensor)
        and not isinstance(src, DTensor)
        and src.ndim > 0
        and tuple(src.shape) == dst._spec.shape
    )
    if not plain_full:
        return dispatch_by_rules(DTensor, func, args, kwargs)
    spec = dst._spec
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        if spec.has_partial():
            raise ValueError(
                "copy_: cannot copy a plain tensor into a DTensor with Partial placements "
                f"{spec.placements}; redistribute it to Replicate/Shard first"
            )
        piece = local_shard(src, mesh.shape, coordinate, spec.placements)
        dst._local_tensor.copy_(piece, *args[2:], **kwargs)
    return dst


@register_special(aten._local_scalar_dense.default)
def _item(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``.item()``: the value of the whole (one-element) tensor, the same on every rank."""
    x: DTensor = args[0]
    return func(redistribute_local(x._local_tensor, x._spec, replicate_all(x._spec.mesh.ndim)))

"""Ops handled as a whole call rather than shard by shard."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._api import DTensor, _local_slice
from hyper_parallel.dtensor._dispatch import dispatch_by_rules, register_special

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
    if isinstance(dst, DTensor) and isinstance(src, torch.Tensor) and not isinstance(src, DTensor):
        if src.ndim > 0 and tuple(src.shape) == dst._spec.shape:
            spec = dst._spec
            mesh = spec.mesh
            coordinate = mesh.get_coordinate()
            if coordinate is not None:
                if spec.has_partial():
                    raise ValueError(
                        "copy_: cannot copy a plain tensor into a DTensor with Partial placements "
                        f"{spec.placements}; redistribute it to Replicate/Shard first"
                    )
                piece = _local_slice(src, mesh, coordinate, spec.placements)
                dst._local_tensor.copy_(piece, *args[2:], **kwargs)
            return dst
    return dispatch_by_rules(func, args, kwargs)

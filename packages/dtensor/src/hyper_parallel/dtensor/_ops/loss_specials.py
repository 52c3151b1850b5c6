"""``loss_parallel()``'s whole-call handlers of the loss ops: torch's checks, plain targets, a replicated loss.

Above the DTensor class: each takes the call, checks or rewrites its arguments under
``loss_parallel()`` and hands it to the op's rule (``losses.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._loss_parallel import loss_parallel_active
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._registry import register_special
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, contiguous_strides, replicate_all
from hyper_parallel.dtensor._tensor import DTensor, dispatch_by_rules
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten


def class_sharding_axis(placements: tuple[Placement, ...], class_dim: int, *, where: str) -> int:
    """The one mesh axis sharding ``class_dim`` (loss parallel's rule, torch's error otherwise)."""
    axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == class_dim]
    if len(axes) != 1:
        raise ValueError(
            f"{where} under loss_parallel(): exactly one mesh axis must shard the class dim "
            f"{class_dim}; found placements {placements} with {len(axes)} such axes"
        )
    for a, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"{where} under loss_parallel(): mesh axes other than the class axis must be "
                f"Shard or Replicate; found {p!r} on mesh axis {a}"
            )
    return axes[0]


def _as_replicated(value: Any, like: DTensor) -> Any:
    """A plain tensor argument as a Replicate DTensor on ``like``'s mesh (torch accepts one)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.ndim == 0:
        return value
    mesh = like._spec.mesh
    meta = TensorMeta(value.shape, contiguous_strides(value.shape), value.dtype)
    return DTensor(value, DTensorSpec(mesh, replicate_all(mesh.ndim), meta))


def _nll_forward_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if not (loss_parallel_active() and isinstance(x, DTensor)):
        return dispatch_by_rules(func, args, kwargs)
    axis = class_sharding_axis(x._spec.placements, x.ndim - 1, where="nll_loss")
    args = (x, _as_replicated(args[1], x), _as_replicated(args[2], x), *args[3:])
    loss, total = dispatch_by_rules(func, args, kwargs)
    if loss._spec.placements[axis].is_partial():
        # torch's loss parallel returns the loss replicated over the class axis
        target = tuple(Replicate() if a == axis else p for a, p in enumerate(loss._spec.placements))
        loss = DTensor(
            redistribute_local(loss._local_tensor, loss._spec, target),
            loss._spec.with_placements(target),
        )
    return loss, total


def _nll_backward_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[1]
    if loss_parallel_active() and isinstance(x, DTensor):
        args = (args[0], x, *(_as_replicated(a, x) for a in args[2:4]), *args[4:])
    return dispatch_by_rules(func, args, kwargs)


def _log_softmax_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if loss_parallel_active() and isinstance(x, DTensor):
        dim = args[1] + x.ndim if args[1] < 0 else args[1]
        if dim != x.ndim - 1:
            # the fused backward is written for a class dim that is last: (N, C) or (C,)
            raise _class_dim_not_last("log_softmax", x, dim)
        class_sharding_axis(x._spec.placements, dim, where="log_softmax")
    return dispatch_by_rules(func, args, kwargs)


def _class_dim_not_last(where: str, x: DTensor, dim: int) -> NotImplementedError:
    return NotImplementedError(
        f"{where} under loss_parallel(): expected logits of shape (N, C) or (C,) (class dim "
        f"last), found shape {tuple(x.shape)} with the class dim {dim}; flatten the other "
        "dims first: F.cross_entropy(logits.flatten(0, -2), target.flatten())"
    )


def _nll2d_forward_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if loss_parallel_active() and isinstance(x, DTensor):
        raise _class_dim_not_last("nll_loss2d", x, 1)
    return dispatch_by_rules(func, args, kwargs)


register_special(aten.nll_loss_forward.default)(_nll_forward_special)
register_special(aten.nll_loss_backward.default)(_nll_backward_special)
register_special(aten._log_softmax.default)(_log_softmax_special)
register_special(aten.nll_loss2d_forward.default)(_nll2d_forward_special)

"""``loss_parallel()``'s whole-call handlers of the loss ops: torch's checks, plain targets, a replicated loss.

Above the DTensor class: each takes the call, checks or rewrites its arguments under
``loss_parallel()`` and hands it to the op's rule (``losses.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._loss_parallel import loss_parallel_active
from hyper_parallel.dtensor._ops.losses import _MEAN, _NONE
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
        class_sharding_axis(x._spec.placements, dim, where="log_softmax")
        if dim != x.ndim - 1:
            # (N, C, d...) logits: the class-last kernels on a view with the class dim
            # moved last; the result is that view moved back (no copy, no gather)
            moved = aten._log_softmax.default(x.movedim(dim, -1), -1, *args[2:])
            return moved.movedim(-1, dim)
    return dispatch_by_rules(func, args, kwargs)


def _rows_order(x: DTensor) -> tuple[int, ...]:
    """The order of ``(N, C, d...)``'s dims that flattens them to rows with no collective.

    The dims a mesh axis shards come first (in mesh-axis order), the other non-class
    dims next, the class dim (1) last: merging dims whose first one is the sharded one
    keeps the shard, where merging ``(N, d)`` with ``d`` sharded would gather.
    """
    first: list[int] = []
    for p in x._spec.placements:
        if isinstance(p, Shard) and p.dim != 1 and p.dim not in first:
            first.append(p.dim)
    rest = [d for d in range(x.ndim) if d != 1 and d not in first]
    return (*first, *rest, 1)


def _target_order(order: tuple[int, ...]) -> tuple[int, ...]:
    """``order`` of the logits' dims as an order of the target's (the class dim dropped)."""
    return tuple(d if d == 0 else d - 1 for d in order[:-1])


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


def _class_last_rows(x: DTensor, order: tuple[int, ...]) -> DTensor:
    """``(N, C, d...)`` logits as ``(N * prod(d), C)`` rows in ``order``: the class dim last.

    Row order does not change a summed loss; a per-element loss is put back with
    the inverse order.
    """
    rows: DTensor = x.permute(order).reshape(-1, x.shape[1])  # type: ignore[assignment]
    return rows


def _nll2d_forward_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nll_loss2d`` (``(N, C, h, w)`` logits) under loss parallel: the ``(N, C)`` kernels on rows."""
    x = args[0]
    if not (loss_parallel_active() and isinstance(x, DTensor)):
        return dispatch_by_rules(func, args, kwargs)
    class_sharding_axis(x._spec.placements, 1, where="nll_loss2d")
    target = _as_replicated(args[1], x)
    weight = _as_replicated(args[2], x) if len(args) > 2 else kwargs.get("weight")
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", _MEAN)
    ignore_index = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    order = _rows_order(x)
    target_order = _target_order(order)
    ordered_target = target.permute(target_order)
    loss, total = aten.nll_loss_forward.default(
        _class_last_rows(x, order), ordered_target.reshape(-1), weight, reduction, ignore_index
    )
    if reduction == _NONE:
        loss = loss.reshape(ordered_target.shape).permute(_inverse(target_order)).contiguous()
    return loss, total


def _nll2d_backward_special(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nll_loss2d_backward`` under loss parallel: the fused ``(N, C)`` backward on rows."""
    x = args[1]
    if not (loss_parallel_active() and isinstance(x, DTensor)):
        return dispatch_by_rules(func, args, kwargs)
    grad, target, weight, reduction, ignore_index, total = (
        args[0],
        _as_replicated(args[2], x),
        _as_replicated(args[3], x),
        *args[4:7],
    )
    order = _rows_order(x)
    target_order = _target_order(order)
    if reduction == _NONE:
        grad = grad.permute(target_order).reshape(-1)
    rows = aten.nll_loss_backward.default(
        grad,
        _class_last_rows(x, order),
        target.permute(target_order).reshape(-1),
        weight,
        reduction,
        ignore_index,
        total,
    )
    ordered_shape = tuple(x.shape[d] for d in order)
    return rows.reshape(ordered_shape).permute(_inverse(order)).contiguous()


register_special(aten.nll_loss_forward.default)(_nll_forward_special)
register_special(aten.nll_loss_backward.default)(_nll_backward_special)
register_special(aten._log_softmax.default)(_log_softmax_special)
register_special(aten.nll_loss2d_forward.default)(_nll2d_forward_special)
register_special(aten.nll_loss2d_backward.default)(_nll2d_backward_special)

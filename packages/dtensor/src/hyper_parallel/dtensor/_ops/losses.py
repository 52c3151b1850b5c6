"""Sharding rules of the negative log-likelihood loss: batch-sharded and class-sharded inputs.

``nll_loss_forward(input, target, weight, reduction, ignore_index)`` takes
``input`` of shape ``(N, C)`` or ``(C,)``. Per mesh axis the input may be:

* sharded over the batch (target sharded alike): each rank sums its rows; a mean
  divides by the *global* total weight (one all-reduce of a scalar in the forward,
  which returns that total Replicate, so the backward reads it with no collective);
* sharded over the classes (loss parallel; target replicated): each rank picks
  only the targets that fall in its class range, so the loss is ``Partial`` and
  the logits are never gathered. The backward writes the gradient of each picked
  target into the rank's class shard;
* replicated.

Under ``loss_parallel()`` (``hyper_parallel.dtensor.parallel``) the class-sharded
case follows torch's loss parallel: the loss is reduced over the class axes inside
the op (``Replicate`` there, as torch returns it), a plain target or weight is taken
as replicated, and the backward is fused: ``nll_loss_backward`` returns the gradient
of the *logits* (``softmax - one_hot``, no communication) and the sharded
``log_softmax`` backward passes it through. Like torch's, that assumes the
log-probabilities feed only the loss (``F.cross_entropy``). ``(N, C, d...)`` logits
(``nll_loss2d``, class dim 1) run the same kernels on rows with the class dim last.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._loss_parallel import loss_parallel_active
from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor._spec import DTensorSpec, local_shape_and_offset
from hyper_parallel.dtensor.collectives import all_reduce_over
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_R = Replicate()
_P = Partial()

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's reduction enum


def _arg(call: OpCall, index: int, name: str, default: Any) -> Any:
    return call.args[index] if len(call.args) > index else call.kwargs.get(name, default)


def _class_range(
    call: OpCall, spec_index: int, placements: tuple[Placement, ...], class_dim: int
) -> tuple[int, int]:
    """``(start, length)`` of this rank's classes of ``call.specs[spec_index]`` laid out so."""
    mesh = call.mesh
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    spec = call.specs[spec_index]
    shape, offset = local_shape_and_offset(spec.shape, mesh.shape, coordinate, placements)
    return offset[class_dim], shape[class_dim]


def _nll_forward_rule(call: OpCall) -> Decision | None:
    x = call.specs[0]
    if x.ndim not in (1, 2):
        return None
    reduction = _arg(call, 3, "reduction", _MEAN)
    class_dim = x.ndim - 1
    batched = x.ndim == 2
    n_extra = len(call.specs) - 2  # the class weights, replicated

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        if batched:
            loss: Placement = Shard(0) if reduction == _NONE else _P
            # a mean's kernel all-reduces the total weight: it returns the global one
            total: Placement = _P if reduction == _SUM else _R
            cands.append(((Shard(0), Shard(0)) + (_R,) * n_extra, (loss, total)))
        cands.append(((Shard(class_dim), _R) + (_R,) * n_extra, (_P, _R)))
        cands.append(((_R,) * len(call.specs), (_R, _R)))
        return cands

    decision = choose(call, candidates)
    x_layout = decision.inputs[0]
    batch_axes = [a for a, p in enumerate(x_layout) if batched and p == Shard(0)]
    class_sharded = any(p == Shard(class_dim) for p in x_layout)
    if class_sharded or (batch_axes and reduction == _MEAN):
        start, length = _class_range(call, 0, x_layout, class_dim) if class_sharded else (0, -1)
        axes = tuple(batch_axes) if reduction == _MEAN else ()
        decision.local_fn = _nll_forward(start, length, class_sharded, call.mesh, axes)
        decision.reduces = axes
    return decision


def _picked(
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    start: int,
    length: int,
    class_sharded: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the weight of its target (0 when ignored), the mask of rows whose target
    this rank holds, the local column of the target, and the picked value (0 elsewhere)."""
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    w = valid.to(x.dtype) if weight is None else weight[safe] * valid
    if class_sharded:
        local = safe - start
        mine = valid & (local >= 0) & (local < length)
        column = torch.where(mine, local, 0)
    else:
        mine = valid
        column = safe
    if x.shape[-1] == 0:
        picked = x.new_zeros(target.shape)
    else:
        picked = x.gather(-1, column.unsqueeze(-1)).squeeze(-1)
    return w, mine, column, torch.where(mine, picked, 0)


def _nll_forward(
    start: int, length: int, class_sharded: bool, mesh: DeviceMesh, axes: tuple[int, ...]
) -> Any:
    def nll(
        x: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        reduction: int,
        ignore_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w, _, _, picked = _picked(x, target, weight, ignore_index, start, length, class_sharded)
        losses = -picked * w
        if reduction == _NONE:
            return losses, x.new_zeros(())
        total = w.sum()
        loss = losses.sum()
        if reduction == _MEAN:
            # the global total is the Replicate total weight: the backward reads it as is
            total = all_reduce_over(total, mesh, axes, "sum")
            loss = loss / total
        return loss, total

    return nll


def _nll_backward_rule(call: OpCall) -> Decision | None:
    # specs: grad_output, self, target, [weight], total_weight
    x = call.specs[1]
    if x.ndim not in (1, 2):
        return None
    reduction = _arg(call, 4, "reduction", _MEAN)
    class_dim = x.ndim - 1
    batched = x.ndim == 2
    n_extra = len(call.specs) - 3  # weight and total weight, replicated
    # only a mean reads the total weight: otherwise it stays as it is (a Partial of a
    # batch-sharded sum is never reduced, as torch)
    total_unread = reduction != _MEAN and isinstance(
        _arg(call, 6, "total_weight", None), DTensorSpec
    )

    def candidates(axis: int) -> list[Candidate]:
        extra: tuple[Placement, ...] = (_R,) * n_extra
        if total_unread:
            extra = (*extra[:-1], call.specs[-1].placements[axis])
        cands: list[Candidate] = []
        if batched:
            grad_layout: Placement = Shard(0) if reduction == _NONE else _R
            cands.append(((grad_layout, Shard(0), Shard(0), *extra), (Shard(0),)))
        cands.append(((_R, Shard(class_dim), _R, *extra), (Shard(class_dim),)))
        cands.append(((_R,) * (len(call.specs) - n_extra) + extra, (_R,)))
        return cands

    decision = choose(call, candidates)
    x_layout = decision.inputs[1]
    if any(p == Shard(class_dim) for p in x_layout):
        start, length = _class_range(call, 1, x_layout, class_dim)
        decision.local_fn = _nll_backward(start, length)
    return decision


def _nll_backward(start: int, length: int) -> Any:
    def backward(
        grad: torch.Tensor,
        x: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        reduction: int,
        ignore_index: int,
        total_weight: torch.Tensor,
    ) -> torch.Tensor:
        w, mine, column, _ = _picked(x, target, weight, ignore_index, start, length, True)
        coef = -w * grad
        if reduction == _MEAN:
            coef = coef / total_weight
        out = torch.zeros_like(x)
        if x.shape[-1] != 0:
            values = torch.where(mine, coef, 0).to(x.dtype)
            out.scatter_(-1, column.unsqueeze(-1), values.unsqueeze(-1))
        if loss_parallel_active():
            # The gradient of the logits: each row's gradient sums to ``coef`` over all
            # classes (one rank holds the target), so log_softmax's backward needs no
            # all-reduce; it passes this through (reductions._sharded_log_softmax_backward).
            out = out - x.exp() * coef.unsqueeze(-1).to(x.dtype)
        return out

    return backward


def _nll2d_forward_rule(call: OpCall) -> Decision:
    """nll_loss2d (input ``(N, C, H, W)``, target ``(N, H, W)``): the batch shards, as in torch.

    Each rank sums its rows; a mean divides by the global total weight (one all-reduce
    of a scalar). A shard of any other dim is gathered.
    """
    reduction = _arg(call, 3, "reduction", _MEAN)
    n_extra = len(call.specs) - 2

    def candidates(axis: int) -> list[Candidate]:
        loss: Placement = Shard(0) if reduction == _NONE else _P
        total: Placement = _P if reduction == _SUM else _R  # a mean returns the global total
        return [
            ((Shard(0), Shard(0)) + (_R,) * n_extra, (loss, total)),
            ((_R,) * len(call.specs), (_R, _R)),
        ]

    decision = choose(call, candidates)
    batch_axes = [a for a, p in enumerate(decision.inputs[0]) if p == Shard(0)]
    if batch_axes and reduction == _MEAN:
        decision.local_fn = _nll2d_mean(call.mesh, tuple(batch_axes))
        decision.reduces = tuple(batch_axes)
    return decision


def _nll2d_mean(mesh: DeviceMesh, axes: tuple[int, ...]) -> Any:
    def nll2d(
        x: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        reduction: int,
        ignore_index: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, total = aten.nll_loss2d_forward.default(x, target, weight, _SUM, ignore_index)
        total = all_reduce_over(total, mesh, axes, "sum")
        return loss / total, total

    return nll2d


def _nll2d_backward_rule(call: OpCall) -> Decision:
    # specs: grad_output, self, target, [weight], total_weight (the global total: Replicate)
    reduction = _arg(call, 4, "reduction", _MEAN)
    n_extra = len(call.specs) - 3
    # only a mean reads the total weight (as in nll_loss_backward's rule)
    total_unread = reduction != _MEAN and isinstance(
        _arg(call, 6, "total_weight", None), DTensorSpec
    )

    def candidates(axis: int) -> list[Candidate]:
        grad_layout: Placement = Shard(0) if reduction == _NONE else _R
        extra: tuple[Placement, ...] = (_R,) * n_extra
        if total_unread:
            extra = (*extra[:-1], call.specs[-1].placements[axis])
        return [
            ((grad_layout, Shard(0), Shard(0), *extra), (Shard(0),)),
            ((_R,) * (len(call.specs) - n_extra) + extra, (_R,)),
        ]

    return choose(call, candidates)


register_rule(aten.nll_loss_forward.default)(_nll_forward_rule)
register_rule(aten.nll_loss2d_forward.default)(_nll2d_forward_rule)
register_rule(aten.nll_loss2d_backward.default)(_nll2d_backward_rule)
register_rule(aten.nll_loss_backward.default)(_nll_backward_rule)

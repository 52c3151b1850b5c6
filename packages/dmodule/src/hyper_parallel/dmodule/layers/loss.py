"""Loss-parallel cross-entropy: the softmax over a class dimension that stays sharded over ``tp``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hyper_parallel.dtensor import DTensor, Replicate, Shard
from hyper_parallel.dtensor._comm_log import record
from hyper_parallel.platform import get_platform

__all__ = ["cross_entropy"]


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``(..., classes)`` against integer ``targets`` ``(...)``.

    When ``logits`` is a DTensor sharded along its last (class) dimension on one mesh
    axis (and replicated on the others), the full logits are never gathered: each
    rank works on its class slice and three all-reduces of ``(tokens,)``-sized
    vectors (max, sum of exponentials, target logit) give the exact loss; the
    backward needs no communication. ``targets`` is a plain tensor, the same on
    every rank of that axis. Other inputs fall back to ``F.cross_entropy``. The
    result is a plain scalar tensor, equal on every rank.

    Example::

        >>> logits, targets = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
        >>> torch.allclose(cross_entropy(logits, targets),
        ...                F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        True
    """
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
    class_dim = logits.ndim - 1
    sharded = [
        axis
        for axis, p in enumerate(logits.placements)
        if isinstance(p, Shard) and p.dim in (class_dim, -1)
    ]
    others_replicated = all(
        isinstance(p, Replicate) for axis, p in enumerate(logits.placements) if axis not in sharded
    )
    if len(sharded) != 1 or not others_replicated:
        full = logits.full_tensor()
        return F.cross_entropy(full.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
    mesh, axis = logits.device_mesh, sharded[0]
    local = logits.to_local()
    n = mesh.size(axis)
    classes = logits.shape[-1]
    per_rank = -(-classes // n)  # torch.chunk sizes
    start = min(per_rank * mesh.get_local_rank(axis), classes)
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(
        local.flatten(0, -2),
        targets.flatten().to(local.device),
        start,
        ignore_index,
        mesh.get_group(axis),
        n,
    )
    return loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over class-sharded local logits ``(tokens, local_classes)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        targets: torch.Tensor,
        start: int,
        ignore_index: int,
        group: Any,
        group_size: int,
    ) -> torch.Tensor:
        platform = get_platform()
        x = local.float()
        row_max = x.max(dim=-1).values
        record("all_reduce", row_max, group_size)
        row_max = platform.all_reduce(row_max, group, "max")
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        record("all_reduce", sum_exp, group_size)
        sum_exp = platform.all_reduce(sum_exp, group, "sum")
        valid = targets != ignore_index
        local_target = targets - start
        mine = valid & (local_target >= 0) & (local_target < x.shape[-1])
        safe = local_target.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        record("all_reduce", target_logit, group_size)
        target_logit = platform.all_reduce(target_logit, group, "sum")
        count = valid.sum().clamp(min=1)
        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), safe, mine, valid, count)
        ctx.input_dtype = local.dtype
        return (losses.sum() / count).to(local.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        softmax, safe, mine, valid, count = ctx.saved_tensors
        grad_local = softmax.clone()
        grad_local.scatter_add_(-1, safe.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        grad_local = grad_local * (valid.to(softmax.dtype) / count * grad).unsqueeze(-1)
        return grad_local.to(ctx.input_dtype), None, None, None, None, None

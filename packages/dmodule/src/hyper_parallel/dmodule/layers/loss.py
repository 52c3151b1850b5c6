"""Cross-entropy that works on a plain or a DTensor logits tensor (loss parallel when class-sharded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyper_parallel.dtensor import DTensor, Replicate

__all__ = ["cross_entropy"]


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``(..., classes)`` against integer ``targets`` ``(...)``.

    On a DTensor ``logits`` this is ``F.cross_entropy`` run by hp-dtensor's sharding
    rules: logits sharded along the class dimension are never gathered (loss parallel:
    the softmax all-reduces the row max and the sum of exponentials, and the class-
    sharded ``nll_loss`` picks each rank's targets). ``targets`` is a plain tensor, the
    same on every rank (a DTensor one is gathered first). The result is a plain scalar
    tensor, equal on every rank. Lower-precision logits (bfloat16 under FSDP's mixed
    precision) are scored in float32, as TorchTitan's loss does.

    Example::

        >>> logits, targets = torch.randn(2, 3, 10), torch.randint(0, 10, (2, 3))
        >>> torch.allclose(cross_entropy(logits, targets),
        ...                F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        True
    """
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    logits = logits.float()
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
    if all(p.is_replicate() for p in logits.placements):
        # every rank holds the whole logits: the plain loss, with gradients through to_local
        local = logits.to_local()
        return F.cross_entropy(
            local.flatten(0, -2), targets.to(local.device).flatten(), ignore_index=ignore_index
        )
    mesh = logits.device_mesh
    replicated_targets = DTensor.from_local(
        targets.to(logits.device), mesh, [Replicate()] * mesh.ndim
    )
    loss = F.cross_entropy(
        logits.flatten(0, -2), replicated_targets.flatten(), ignore_index=ignore_index
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss

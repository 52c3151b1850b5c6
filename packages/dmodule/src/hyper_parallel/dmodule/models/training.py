"""Training helpers shared by the demo, the tests and the bench: synthetic data, dp gradient averaging."""

from __future__ import annotations

import torch

from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives
from hyper_parallel.dtensor.fsdp import FSDPModule

__all__ = ["average_gradients", "synthetic_batch"]


def synthetic_batch(
    step: int, *, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of shape ``(batch_size, seq_len)`` for ``step``, from a seeded generator.

    Each row follows the rule ``next = (3 * token + 1) % vocab_size`` from a random
    start, with one token in eight replaced by noise, so a model can learn it. The
    targets are the tokens shifted by one; the same ``(step, seed)`` gives the same
    batch in every process.

    Example::

        >>> tokens, targets = synthetic_batch(0, batch_size=2, seq_len=4, vocab_size=10)
        >>> bool((tokens[:, 1:] == targets[:, :-1]).all())
        True
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    stream = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    stream[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    for position in range(1, seq_len + 1):
        stream[:, position] = (3 * stream[:, position - 1] + 1) % vocab_size
    noise = torch.rand(batch_size, seq_len + 1, generator=generator) < 0.125
    random_tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    stream = torch.where(noise, random_tokens, stream)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def average_gradients(model: torch.nn.Module, mesh: DeviceMesh, axis: str = "dp") -> None:
    """Average every gradient over mesh axis ``axis`` (data parallel), in place of ``.grad``.

    DTensor gradients (on the ``tp`` submesh) are averaged shard by shard: the ranks
    along ``axis`` hold the same shard of different data's gradients.

    Example::

        >>> loss.backward(); average_gradients(model, mesh, "dp"); optimizer.step()  # doctest: +SKIP
    """
    fsdp = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, FSDPModule)
    ]
    if fsdp:
        raise ValueError(
            f"average_gradients: {fsdp[0]!r} is fully sharded (fully_shard); FSDP already averages "
            "its gradients over its data-parallel mesh: use one data-parallel scheme per model"
        )
    if mesh.size(axis) == 1:
        return
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            reduced = collectives.all_reduce(grad.to_local(), mesh, axis, "avg")
            param.grad = DTensor.from_local(
                reduced, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
            )
        else:
            param.grad = collectives.all_reduce(grad, mesh, axis, "avg")

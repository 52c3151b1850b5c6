"""The Megatron baseline's differentiable collectives (``bench/baselines/_collectives.py``): forward values and input gradients against one-process autograd.

The distributed loss is ``sum over ranks of (weight_r * output_r).sum()``; the
oracle builds the same loss from all ranks' inputs in one process and lets
autograd differentiate it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from bench.baselines import _collectives as collectives
from tests._harness import run_on_ranks, world_sizes

CHUNK = (2, 3)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "copy", "reduce_from")


def _input(op: str, rank: int, world_size: int) -> torch.Tensor:
    # copy_to_parallel takes a replicated input: the same values on every rank.
    seed_rank = 0 if op == "copy" else rank
    gen = torch.Generator().manual_seed(7 * seed_rank + OPS.index(op))
    stacked = op in ("reduce_scatter", "all_to_all")
    shape = (world_size, *CHUNK) if stacked else CHUNK
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _weight(op: str, rank: int, shape: torch.Size) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + 7 * rank + OPS.index(op))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


_DISTRIBUTED: dict[str, Callable[[torch.Tensor, dist.ProcessGroup | None], torch.Tensor]] = {
    "all_gather": collectives.all_gather,
    "reduce_scatter": collectives.reduce_scatter,
    "all_reduce": collectives.all_reduce,
    "all_to_all": collectives.all_to_all,
    "copy": collectives.copy_to_parallel,
    "reduce_from": collectives.reduce_from_parallel,
}


def _forward_backward(world_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per op: this rank's output and its input's gradient."""
    rank = dist.get_rank()
    results = {}
    for op, fn in _DISTRIBUTED.items():
        x = _input(op, rank, world_size).requires_grad_()
        y = fn(x, None)
        # Megatron's reduce_from_parallel assumes every rank computes the same loss.
        weight_rank = 0 if op == "reduce_from" else rank
        torch.autograd.backward((_weight(op, weight_rank, y.shape) * y).sum())
        assert x.grad is not None
        results[op] = (y.detach(), x.grad)
    return results


def _oracle(op: str, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and input gradients of every rank, from one-process autograd."""
    ranks = range(world_size)
    xs = [_input(op, r, world_size).requires_grad_() for r in ranks]
    if op == "all_gather":
        ys = [torch.stack(xs)] * world_size
    elif op == "reduce_scatter":
        ys = [torch.stack(xs).sum(0)[r] for r in ranks]
    elif op == "all_reduce":
        ys = [torch.stack(xs).sum(0)] * world_size
    elif op == "all_to_all":
        ys = [torch.stack([xs[src][r] for src in ranks]) for r in ranks]
    elif op == "copy":
        ys = [xs[0]] * world_size  # one replicated input feeds every rank's loss
    else:  # reduce_from: the shared loss is computed once from the reduced value
        total = torch.stack(xs).sum(0)
        torch.autograd.backward((_weight(op, 0, total.shape) * total).sum())
        return [total.detach()] * world_size, _grads(xs)
    loss = sum((_weight(op, r, ys[r].shape) * ys[r]).sum() for r in ranks)
    assert isinstance(loss, torch.Tensor)
    torch.autograd.backward(loss)
    # copy: each rank's replica gets the full gradient of the one replicated input.
    grads = _grads(xs[:1]) * world_size if op == "copy" else _grads(xs)
    return [y.detach() for y in ys], grads


def _grads(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = [x.grad for x in xs]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None]


@world_sizes()
def test_differentiable_collectives_match_one_process_autograd(world_size: int) -> None:
    results = run_on_ranks(_forward_backward, world_size, world_size)
    for op in OPS:
        outputs, grads = _oracle(op, world_size)
        for rank, per_op in enumerate(results):
            y, grad = per_op[op]
            torch.testing.assert_close(y, outputs[rank], msg=f"{op} forward, rank {rank}")
            torch.testing.assert_close(grad, grads[rank], msg=f"{op} backward, rank {rank}")

"""The Megatron baseline's differentiable collectives: autograd functions whose backward is the exact adjoint.

A private helper of ``bench/baselines/megatron.py`` (hand-written tensor parallelism
calls process groups directly, as Megatron-LM does): the product's collectives go
through ``hyper_parallel.dtensor.collectives``, which records every call.

"Exact" assumes the training loss is the *sum* over ranks of each rank's loss,
so the gradient of a collective's input is the adjoint collective applied to the
gradients of its outputs on every rank:

====================  ====================================
forward               backward
====================  ====================================
all_gather            reduce_scatter(sum)
reduce_scatter(sum)   all_gather
all_reduce(sum)       all_reduce(sum)
all_to_all            all_to_all (it is its own inverse)
====================  ====================================

``copy_to_parallel`` / ``reduce_from_parallel`` are the Megatron-LM conjugate
pair (identity ↔ all-reduce), which assume instead that every rank computes the
*same* loss from replicated values, as in hand-written tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from hyper_parallel.platform_torch import comm

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "copy_to_parallel",
    "reduce_from_parallel",
    "reduce_scatter",
]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.all_gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.reduce_scatter(grad, ctx.group, "sum"), None


class _ReduceScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.reduce_scatter(tensor, group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_gather(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.all_reduce(tensor, group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(grad, ctx.group, "sum"), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return comm.all_to_all(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_to_all(grad, ctx.group), None


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(grad, ctx.group, "sum"), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return comm.all_reduce(tensor, group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-gather, shape ``(group_size, *shape)``; backward reduce-scatters (sum).

    Example::

        >>> stacked = all_gather(x, group)  # doctest: +SKIP
    """
    result: torch.Tensor = _AllGather.apply(tensor, group)
    return result


def reduce_scatter(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum reduce-scatter of ``(group_size, *chunk)``; backward all-gathers.

    Example::

        >>> chunk = reduce_scatter(x, group)  # doctest: +SKIP
    """
    result: torch.Tensor = _ReduceScatterSum.apply(tensor, group)
    return result


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum all-reduce; backward all-reduces (sum) the gradient.

    Example::

        >>> total = all_reduce(x, group)  # doctest: +SKIP
    """
    result: torch.Tensor = _AllReduceSum.apply(tensor, group)
    return result


def all_to_all(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all of ``(group_size, *chunk)``; backward is the inverse all-to-all.

    Example::

        >>> exchanged = all_to_all(x, group)  # doctest: +SKIP
    """
    result: torch.Tensor = _AllToAll.apply(tensor, group)
    return result


def copy_to_parallel(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Megatron "f": identity forward, sum all-reduce of the gradient backward.

    Example::

        >>> x = copy_to_parallel(x, tp_group)  # before a column-parallel linear  # doctest: +SKIP
    """
    result: torch.Tensor = _CopyToParallel.apply(tensor, group)
    return result


def reduce_from_parallel(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Megatron "g": sum all-reduce forward, identity backward.

    Example::

        >>> y = reduce_from_parallel(partial_y, tp_group)  # after a row-parallel linear  # doctest: +SKIP
    """
    result: torch.Tensor = _ReduceFromParallel.apply(tensor, group)
    return result

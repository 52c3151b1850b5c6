"""What every bench implementation provides (a train step) and receives (its rank's context)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from bench.common.llama import LlamaConfig
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class TPContext:
    """One rank's view of the tensor-parallel group the bench runs in.

    ``torch_mesh`` is a 1-D torch ``DeviceMesh`` over ``group`` (axis name ``"tp"``);
    implementations on other engines build their own mesh from ``world_size``/``device_type``.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup
    torch_mesh: DeviceMesh
    device_type: str = "cpu"


class TrainStep(Protocol):
    """A built implementation: forward to a scalar loss; the bench calls ``backward()`` on it."""

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the forward pass and return the mean cross-entropy loss (with its graph)."""
        ...

    def zero_grad(self) -> None:
        """Drop every parameter gradient (set to ``None``)."""
        ...

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gather every parameter gradient to a full tensor, keyed like ``make_full_weights``.

        Collective: every rank must call it.
        """
        ...

    def parameters(self) -> list[torch.Tensor]:
        """What an optimizer steps: this rank's parameters (local shards or DTensors)."""
        ...


StepFactory = Callable[[LlamaConfig, Mapping[str, torch.Tensor], TPContext], TrainStep]
"""Builds a rank's ``TrainStep`` from the shapes, the full weights and the rank's context."""


def shard_of(full: torch.Tensor, dim: int, ctx: TPContext) -> torch.Tensor:
    """This rank's ``torch.chunk`` shard of ``full`` along ``dim``, as a fresh contiguous tensor.

    Example:
        >>> shard_of(torch.arange(4.0), 0, ctx).tolist()  # rank 1 of 2  # doctest: +SKIP
        [2.0, 3.0]
    """
    chunks = torch.chunk(full, ctx.world_size, dim=dim)
    if len(chunks) != ctx.world_size:
        raise ValueError(
            f"shard_of: dim {dim} of size {full.shape[dim]} gives {len(chunks)} chunks, "
            f"expected one per rank ({ctx.world_size})"
        )
    return chunks[ctx.rank].detach().clone().contiguous()


def gather_shards(local: torch.Tensor, dim: int, ctx: TPContext) -> torch.Tensor:
    """Concatenate every rank's ``local`` along ``dim`` (an all-gather; collective).

    Example:
        >>> gather_shards(torch.tensor([float(ctx.rank)]), 0, ctx).tolist()  # 2 ranks  # doctest: +SKIP
        [0.0, 1.0]
    """
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.group)
    return torch.cat(parts, dim=dim)

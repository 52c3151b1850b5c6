"""Bench entry (f): the model of (b), parallelized with hp-dtensor's ``parallelize_module``.

The very code of entry (b) (``bench.baselines.torch_tp``) with torch's TP API swapped for
``hyper_parallel.dtensor.parallel``: same plan, same ``Llama`` module, hp DTensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from bench.baselines.torch_tp import TorchTPStep
from bench.common.harness import TPContext, TrainStep
from bench.common.llama import LlamaConfig

import hyper_parallel.dtensor.parallel as hp_parallel
from hyper_parallel.dtensor import Replicate, init_device_mesh

__all__ = ["build_hp_tp_step", "build_hp_tp_step_no_overlap"]


def build_hp_tp_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> TorchTPStep:
    """(f): entry (b) on hp-dtensor's ``parallelize_module`` (changed imports only).

    Example:
        >>> step = build_hp_tp_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    mesh = init_device_mesh(ctx.device_type, (ctx.world_size,), mesh_dim_names=("tp",))
    return TorchTPStep(
        cfg, full_weights, ctx, parallel=hp_parallel, mesh=mesh, replicate=Replicate()
    )


class _WithoutOverlap:
    """A step whose column-parallel linears reduce their input gradients after the matmuls."""

    def __init__(self, step: TrainStep) -> None:
        self._step = step

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with hp_parallel.overlap_grad_reduce(False):
            return self._step.forward_loss(tokens, targets)

    def zero_grad(self) -> None:
        self._step.zero_grad()

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._step.full_grads()

    def parameters(self) -> list[torch.Tensor]:
        return self._step.parameters()


def build_hp_tp_step_no_overlap(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> TrainStep:
    """(f) with ``overlap_grad_reduce(False)``: the input-gradient all-reduces not overlapped.

    Example:
        >>> step = build_hp_tp_step_no_overlap(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return _WithoutOverlap(build_hp_tp_step(cfg, full_weights, ctx))

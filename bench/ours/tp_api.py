"""Bench entry (f): the model of (b), parallelized with hp-dtensor's ``parallelize_module``.

The very code of entry (b) (``bench.baselines.torch_tp``) with torch's TP API swapped for
``hyper_parallel.dtensor.parallel``: same plan, same ``Llama`` module, hp DTensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from bench.baselines.torch_tp import TorchTPStep
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig

import hyper_parallel.dtensor.parallel as hp_parallel
from hyper_parallel.dtensor import Replicate, init_device_mesh

__all__ = ["build_hp_tp_step"]


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

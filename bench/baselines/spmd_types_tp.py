"""TorchTitan's peer: Megatron's tensor parallelism written with ``spmd_types`` (0.3.1).

``spmd_types`` keeps activations as plain local tensors and calls typed differentiable
collectives at region boundaries; with type checking off (as TorchTitan runs it) what
remains at run time is its collectives' autograd functions. The model is Megatron's
(``bench/baselines/megatron.py``, same parameters and shards); only the conjugate pair
changes, by the library's own mapping of Megatron's functions:

- entering a TP region (``copy_to_tensor_model_parallel_region``):
  ``spmd.convert(x, tp, src=I, dst=R)``: identity forward, all-reduce backward;
- leaving it (``reduce_from_tensor_model_parallel_region``):
  ``spmd.all_reduce(x, tp, dst=I)``: all-reduce forward, identity backward.

Optional: ``spmd-types`` is in the workspace's ``bench`` dependency group (``uv run
--group bench python bench/step_bench.py``); without it the bench reports this
implementation as skipped.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from bench.baselines.megatron import MegatronStep
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig

# optional (the bench group): an ImportError here makes step_bench report it skipped;
# imported by name so that type checking needs neither the package nor its stubs
spmd: Any = importlib.import_module("spmd_types")


class SpmdTypesStep(MegatronStep):
    """Megatron's step with ``spmd_types``' collectives at the TP region boundaries."""

    def copy_in(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        out: torch.Tensor = spmd.convert(x, group, src=spmd.I, dst=spmd.R)
        return out

    def reduce_out(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        out: torch.Tensor = spmd.all_reduce(x, group, dst=spmd.I)
        return out


def build_spmd_types_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> SpmdTypesStep:
    """Bench factory for the ``spmd_types`` implementation.

    Example:
        >>> step = build_spmd_types_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return SpmdTypesStep(cfg, full_weights, ctx)

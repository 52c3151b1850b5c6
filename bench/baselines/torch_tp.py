"""The bench model under ``torch.distributed.tensor.parallel.parallelize_module``.

Same layout as the Megatron baseline: ``wq``/``wk``/``wv``/``w1``/``w3`` ``ColwiseParallel``,
``wo``/``w2`` ``RowwiseParallel``; embedding, norms and output projection stay plain
replicated modules. ``PrepareModuleInput`` turns the attention and MLP inputs into one
replicated DTensor each, so the three (two) column-parallel projections share it and the
backward all-reduces its Partial gradient once, as Megatron's ``f`` does; without it every
``ColwiseParallel`` would all-reduce its own input gradient (5 backward all-reduces per
block instead of 2).

The plan and the step take the TP API as an argument (``torch.distributed.tensor.parallel``
by default), so entry (f) runs this very code on hp-dtensor's ``parallelize_module``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed.tensor.parallel as torch_parallel
from bench.common.harness import TPContext
from bench.common.llama import Llama, LlamaConfig, cross_entropy_loss
from torch.distributed.tensor import Replicate


def torch_tp_plan(
    cfg: LlamaConfig, parallel: ModuleType = torch_parallel, replicate: Any = None
) -> dict[str, Any]:
    """The ``parallelize_module`` plan for ``Llama`` (module FQN -> style of ``parallel``).

    ``replicate`` is that API's ``Replicate()`` (default: torch's).

    Example:
        >>> type(torch_tp_plan(LlamaConfig(n_layers=1))["layers.0.attention.wo"]).__name__
        'RowwiseParallel'
    """
    replicate = Replicate() if replicate is None else replicate
    plan: dict[str, Any] = {}
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        for region, colwise, rowwise in (
            ("attention", ("wq", "wk", "wv"), "wo"),
            ("feed_forward", ("w1", "w3"), "w2"),
        ):
            plan[pre + region] = parallel.PrepareModuleInput(
                input_layouts=(replicate,), desired_input_layouts=(replicate,)
            )
            for name in colwise:
                plan[f"{pre}{region}.{name}"] = parallel.ColwiseParallel()
            plan[f"{pre}{region}.{rowwise}"] = parallel.RowwiseParallel()
    return plan


class TorchTPStep:
    """Train step of ``Llama`` parallelized with torch's tensor-parallel API (or one like it).

    ``parallel``, ``mesh`` and ``replicate`` pick the API: torch's by default.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        full_weights: Mapping[str, torch.Tensor],
        ctx: TPContext,
        *,
        parallel: ModuleType = torch_parallel,
        mesh: Any = None,
        replicate: Any = None,
    ) -> None:
        cfg.check_tensor_parallel(ctx.world_size)
        model = Llama(cfg)
        model.load_state_dict(dict(full_weights))
        # src_data_rank=None: every rank holds the same full weights, so each slices its own
        # shard locally instead of receiving it from rank 0.
        self.model = parallel.parallelize_module(
            model,
            ctx.torch_mesh if mesh is None else mesh,
            torch_tp_plan(cfg, parallel, replicate),
            src_data_rank=None,
        )

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward pass to the mean cross-entropy loss."""
        return cross_entropy_loss(self.model(tokens), targets)

    def zero_grad(self) -> None:
        """Drop every gradient."""
        self.model.zero_grad(set_to_none=True)

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (DTensors and plain), for an optimizer."""
        return list(self.model.parameters())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients: DTensor ones via ``full_tensor()`` (collective), plain ones as they are."""
        grads: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            grad = param.grad
            if grad is None:
                raise RuntimeError(
                    f"TorchTPStep.full_grads: {name} has no gradient; run a step first"
                )
            grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return grads


def build_torch_tp_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> TorchTPStep:
    """Bench factory for the torch ``parallelize_module`` baseline.

    Example:
        >>> step = build_torch_tp_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return TorchTPStep(cfg, full_weights, ctx)

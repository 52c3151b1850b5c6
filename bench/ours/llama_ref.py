"""Bench entries (c) and (d): the hp-dmodule reference Llama with the bench model's shapes and weights.

Both use the same plan as the Megatron baseline (a): column-parallel ``wq/wk/wv/w1/w3``,
row-parallel ``wo/w2``, replicated embedding, norms and output projection, RoPE off.
(c) runs every op of the blocks on DTensors; (d) runs attention and the MLP as
``local_map`` modules on local tensors; ``ours_ref_region`` adds ``region_blocks``: each
block one outer ``local_map`` region, the residual stream and its adds plain local tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig

from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import DTensor, init_device_mesh

__all__ = [
    "build_dtensor_step",
    "build_local_map_step",
    "build_region_blocks_step",
    "full_grads",
    "zero_grads",
]


class ReferenceLlamaStep:
    """A train step of the parallelized reference model (the bench's ``TrainStep``)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        full_weights: Mapping[str, torch.Tensor],
        ctx: TPContext,
        *,
        local_map: bool,
        region_blocks: bool = False,
    ) -> None:
        cfg.check_tensor_parallel(ctx.world_size)
        config = Llama.Config(
            vocab_size=cfg.vocab,
            dim=cfg.dim,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            ffn_dim=cfg.hidden_dim,
            max_seq_len=cfg.seq,
            norm_eps=cfg.norm_eps,
            use_rope=False,
            use_local_map=local_map,
            region_blocks=region_blocks,
            vocab_parallel=False,
        )
        mesh = init_device_mesh(ctx.device_type, (ctx.world_size,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = config.build()
        model.parallelize(mesh)
        model.to_empty(device=ctx.device_type)
        model.init_states()
        missing, unexpected = model.load_state_dict(dict(full_weights), strict=False)
        if unexpected or [m for m in missing if "rope" not in m]:
            raise ValueError(
                f"weights do not match the model: missing {missing}, unexpected {unexpected}"
            )
        self.model = model
        self.params = dict(model.named_parameters())

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward to the mean cross-entropy loss."""
        loss: torch.Tensor = self.model.loss(tokens, targets)
        return loss

    def zero_grad(self) -> None:
        """Drop every gradient."""
        zero_grads(self.params)

    def parameters(self) -> list[torch.Tensor]:
        """The model's parameters (DTensors), for an optimizer."""
        return list(self.params.values())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient as a full tensor (collective)."""
        return full_grads(self.params)


def zero_grads(params: Mapping[str, torch.Tensor]) -> None:
    """Drop the gradient of every parameter."""
    for p in params.values():
        p.grad = None


def full_grads(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor, by name (collective).

    Example:
        >>> grads = full_grads(dict(model.named_parameters()))  # doctest: +SKIP
    """
    grads: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        g = p.grad
        assert g is not None, name
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return grads


def build_dtensor_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> ReferenceLlamaStep:
    """(c): every op of the model on DTensors."""
    return ReferenceLlamaStep(cfg, full_weights, ctx, local_map=False)


def build_local_map_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> ReferenceLlamaStep:
    """(d): attention and MLP blocks as local_map modules."""
    return ReferenceLlamaStep(cfg, full_weights, ctx, local_map=True)


def build_region_blocks_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> ReferenceLlamaStep:
    """(d) with ``region_blocks``: each block one outer region, plain tensors between its parts."""
    return ReferenceLlamaStep(cfg, full_weights, ctx, local_map=True, region_blocks=True)

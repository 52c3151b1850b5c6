"""Hand-written Megatron-style tensor parallelism on plain tensors: the eager lower bound.

Per block: ``wq``/``wk``/``wv`` and ``w1``/``w3`` are column-parallel (weight dim 0 split,
so each rank owns ``n_heads / world`` query heads and ``n_kv_heads / world`` kv heads),
``wo`` and ``w2`` are row-parallel (weight dim 1 split). The conjugate ops ``f``
(``copy_to_parallel``) and ``g`` (``reduce_from_parallel``) bracket attention and MLP, so a
block costs exactly 2 all-reduces forward (the two ``g``) and 2 backward (the two ``f``).
No sequence parallelism. RMSNorm scales, the embedding and the output projection are
replicated: every rank computes them on the same full activations, so their gradients are
already identical across ranks and need no reduction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from bench.baselines._collectives import copy_to_parallel, reduce_from_parallel
from bench.common.harness import TPContext, gather_shards, shard_of
from bench.common.llama import LlamaConfig, causal_attention, cross_entropy_loss, rms_norm

COLUMN_PARALLEL = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "feed_forward.w1",
    "feed_forward.w3",
)
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


def megatron_shard_dim(name: str) -> int | None:
    """Weight dim split across ranks for parameter ``name`` (None: replicated).

    Example:
        >>> megatron_shard_dim("layers.3.attention.wo.weight"), megatron_shard_dim("norm.weight")
        (1, None)
    """
    module = name.rsplit(".", 1)[0]
    if module.endswith(COLUMN_PARALLEL):
        return 0
    if module.endswith(ROW_PARALLEL):
        return 1
    return None


class MegatronStep:
    """Megatron TP train step over plain local tensors (see the module docstring)."""

    def __init__(
        self, cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
    ) -> None:
        cfg.check_tensor_parallel(ctx.world_size)
        self.cfg = cfg
        self.ctx = ctx
        self.params: dict[str, torch.Tensor] = {}
        for name, full in full_weights.items():
            dim = megatron_shard_dim(name)
            local = full.detach().clone() if dim is None else shard_of(full, dim, ctx)
            self.params[name] = local.requires_grad_(True)

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward pass to the mean cross-entropy loss."""
        p, cfg, group = self.params, self.cfg, self.ctx.group
        batch, seq = tokens.shape
        h = F.embedding(tokens, p["tok_embeddings.weight"])
        for i in range(cfg.n_layers):
            pre = f"layers.{i}."
            x = self.copy_in(rms_norm(h, p[pre + "attention_norm.weight"], cfg.norm_eps), group)
            q = F.linear(x, p[pre + "attention.wq.weight"]).view(batch, seq, -1, cfg.head_dim)
            k = F.linear(x, p[pre + "attention.wk.weight"]).view(batch, seq, -1, cfg.head_dim)
            v = F.linear(x, p[pre + "attention.wv.weight"]).view(batch, seq, -1, cfg.head_dim)
            attn = F.linear(causal_attention(q, k, v), p[pre + "attention.wo.weight"])
            h = h + self.reduce_out(attn, group)
            x = self.copy_in(rms_norm(h, p[pre + "ffn_norm.weight"], cfg.norm_eps), group)
            gate = F.silu(F.linear(x, p[pre + "feed_forward.w1.weight"]))
            up = F.linear(x, p[pre + "feed_forward.w3.weight"])
            mlp = F.linear(gate * up, p[pre + "feed_forward.w2.weight"])
            h = h + self.reduce_out(mlp, group)
        logits = F.linear(rms_norm(h, p["norm.weight"], cfg.norm_eps), p["output.weight"])
        return cross_entropy_loss(logits, targets)

    def copy_in(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """Megatron's ``f``: identity forward, all-reduce backward (entering a TP region)."""
        return copy_to_parallel(x, group)

    def reduce_out(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """Megatron's ``g``: all-reduce forward, identity backward (leaving a TP region)."""
        return reduce_from_parallel(x, group)

    def zero_grad(self) -> None:
        """Drop every gradient."""
        for param in self.params.values():
            param.grad = None

    def parameters(self) -> list[torch.Tensor]:
        """The local shards and replicated tensors an optimizer steps."""
        return list(self.params.values())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients: sharded ones all-gathered, replicated ones as they are (collective)."""
        grads: dict[str, torch.Tensor] = {}
        for name, param in self.params.items():
            if param.grad is None:
                raise RuntimeError(
                    f"MegatronStep.full_grads: {name} has no gradient; run a step first"
                )
            dim = megatron_shard_dim(name)
            grads[name] = param.grad if dim is None else gather_shards(param.grad, dim, self.ctx)
        return grads


def build_megatron_step(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> MegatronStep:
    """Bench factory for the hand-written Megatron baseline.

    Example:
        >>> step = build_megatron_step(cfg, make_full_weights(cfg, 0), ctx)  # doctest: +SKIP
    """
    return MegatronStep(cfg, full_weights, ctx)

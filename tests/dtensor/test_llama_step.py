"""A Llama-style training step on DTensors with Megatron placements equals the one-device step.

The model is written with plain torch functions (embedding, ``F.rms_norm``, RoPE,
``F.scaled_dot_product_attention`` with causal grouped-query attention, a SwiGLU
MLP, an output projection and cross-entropy), so every op it runs reaches the
DTensor dispatcher. Placements follow Megatron-LM: wq/wk/wv/w1/w3 column-parallel
``Shard(0)``, wo/w2 row-parallel ``Shard(1)``, norms replicated, the embedding
replicated or vocab-sharded, the output projection ``Shard(0)`` with the loss
computed on vocab-sharded logits (loss parallel). The oracle is the same step on
full tensors in the test process: the loss and every gradient must match (to a
tolerance relative to each tensor's scale), and no op of the forward/backward may
fall back to the gather-everything path.

The optimizer is checked given identical gradients: the oracle applies one
``torch.optim.AdamW`` step to the full parameters with the gradients the sharded
run produced. AdamW's first step moves every element by about ``lr`` whatever the
size of its gradient, so comparing it after two independent backward passes would
turn a float reordering in a near-zero gradient (which differs between CPUs) into
a visible parameter difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tests._harness import TEST_DEVICE, run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dtensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
    reset_fallback_counts,
)

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LlamaShapes:
    """Tiny model and batch; the vocabulary does not split evenly over 4 ranks."""

    vocab: int = 30
    dim: int = 32
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden: int = 48
    n_layers: int = 2
    batch: int = 2
    seq: int = 8
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SHAPES = LlamaShapes()


def init_params(cfg: LlamaShapes) -> Params:
    """Deterministic full parameters, named like TorchTitan's Llama."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    kv = cfg.n_kv_heads * cfg.head_dim
    params: Params = {"tok_embeddings": randn(cfg.vocab, cfg.dim, scale=1.0)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        params[p + "attention_norm"] = 1.0 + randn(cfg.dim, scale=0.1)
        params[p + "wq"] = randn(cfg.dim, cfg.dim)
        params[p + "wk"] = randn(kv, cfg.dim)
        params[p + "wv"] = randn(kv, cfg.dim)
        params[p + "wo"] = randn(cfg.dim, cfg.dim)
        params[p + "ffn_norm"] = 1.0 + randn(cfg.dim, scale=0.1)
        params[p + "w1"] = randn(cfg.hidden, cfg.dim)
        params[p + "w3"] = randn(cfg.hidden, cfg.dim)
        params[p + "w2"] = randn(cfg.dim, cfg.hidden)
    params["norm"] = 1.0 + randn(cfg.dim, scale=0.1)
    params["output"] = randn(cfg.vocab, cfg.dim)
    return params


def batch(cfg: LlamaShapes) -> dict[str, torch.Tensor]:
    """Tokens, next-token targets and the RoPE tables."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    hd = cfg.head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "targets": tokens[:, 1:].contiguous(),
        "cos": angles.cos(),
        "sin": angles.sin(),
    }


def megatron_placements(cfg: LlamaShapes, *, vocab_sharded_embedding: bool) -> dict[str, Placement]:
    """Column-parallel in-projections, row-parallel out-projections, loss-parallel output."""
    placements: dict[str, Placement] = {
        "tok_embeddings": Shard(0) if vocab_sharded_embedding else Replicate(),
        "norm": Replicate(),
        "output": Shard(0),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv", "w1", "w3"):
            placements[p + name] = Shard(0)
        for name in ("wo", "w2"):
            placements[p + name] = Shard(1)
        placements[p + "attention_norm"] = Replicate()
        placements[p + "ffn_norm"] = Replicate()
    return placements


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``[batch, seq, heads, head_dim]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    seq, hd = cos.shape
    return x * cos.view(1, seq, 1, hd) + rotated * sin.view(1, seq, 1, hd)


def forward_loss(
    params: Mapping[str, torch.Tensor], data: Mapping[str, torch.Tensor], cfg: LlamaShapes
) -> torch.Tensor:
    """Mean next-token cross-entropy of the model (plain torch functions only)."""
    b, s, hd = cfg.batch, cfg.seq, cfg.head_dim
    cos, sin = data["cos"], data["sin"]
    h = F.embedding(data["tokens"], params["tok_embeddings"])
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        x = F.rms_norm(h, (cfg.dim,), params[p + "attention_norm"], cfg.eps)
        q = F.linear(x, params[p + "wq"]).view(b, s, cfg.n_heads, hd)
        k = F.linear(x, params[p + "wk"]).view(b, s, cfg.n_kv_heads, hd)
        v = F.linear(x, params[p + "wv"]).view(b, s, cfg.n_kv_heads, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(b, s, cfg.dim)
        h = h + F.linear(o, params[p + "wo"])
        x = F.rms_norm(h, (cfg.dim,), params[p + "ffn_norm"], cfg.eps)
        gate = F.silu(F.linear(x, params[p + "w1"])) * F.linear(x, params[p + "w3"])
        h = h + F.linear(gate, params[p + "w2"])
    h = F.rms_norm(h, (cfg.dim,), params["norm"], cfg.eps)
    logits = F.linear(h, params["output"])
    return F.cross_entropy(logits.flatten(0, 1), data["targets"].flatten())


def _adamw(params: list[torch.Tensor], foreach: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)


@dataclass
class StepResult:
    """Everything one training step produced, as full tensors."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    updated: dict[str, torch.Tensor]
    fallbacks_fwd_bwd: dict[str, int]
    fallbacks_optimizer: dict[str, int]
    grad_placements: dict[str, tuple[Placement, ...]]


def _reference_step(cfg: LlamaShapes) -> StepResult:
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(cfg).items()}
    loss = forward_loss(params, batch(cfg), cfg)
    torch.autograd.backward(loss)
    grads = {k: v.grad.clone() for k, v in params.items() if v.grad is not None}
    return StepResult(loss.detach(), grads, {}, {}, {}, {})


def _reference_adamw_given(grads: Mapping[str, torch.Tensor], cfg: LlamaShapes) -> Params:
    """One AdamW step on the full initial parameters with the given gradients."""
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(cfg).items()}
    for k, v in params.items():
        v.grad = grads[k].clone()
    _adamw(list(params.values()), foreach=False).step()
    return {k: v.detach() for k, v in params.items()}


def _distributed_steps(world_size: int) -> dict[str, StepResult]:
    """On every rank: one step per (embedding layout, foreach) variant."""
    cfg = SHAPES
    mesh = init_device_mesh(TEST_DEVICE, (world_size,))
    replicate = (Replicate(),)
    data = {k: distribute_tensor(v.to(TEST_DEVICE), mesh, replicate) for k, v in batch(cfg).items()}
    results: dict[str, StepResult] = {}
    for vocab_sharded in (False, True):
        for foreach in (False, True):
            placements = megatron_placements(cfg, vocab_sharded_embedding=vocab_sharded)
            params = {
                k: distribute_tensor(v.to(TEST_DEVICE), mesh, (placements[k],)).requires_grad_(True)
                for k, v in init_params(cfg).items()
            }
            reset_fallback_counts()
            loss = forward_loss(params, data, cfg)
            torch.autograd.backward(loss)
            fwd_bwd = fallback_counts()
            reset_fallback_counts()
            grads: dict[str, torch.Tensor] = {}
            grad_placements: dict[str, tuple[Placement, ...]] = {}
            for k, v in params.items():
                assert isinstance(v.grad, DTensor), f"{k}: gradient is {type(v.grad).__name__}"
                grads[k] = v.grad.full_tensor().cpu()
                grad_placements[k] = v.grad.placements
            _adamw(list(params.values()), foreach=foreach).step()
            optimizer = fallback_counts()
            updated: dict[str, torch.Tensor] = {}
            for k, v in params.items():
                assert isinstance(v, DTensor)
                updated[k] = v.full_tensor().detach().cpu()
            assert isinstance(loss, DTensor)
            name = (
                f"{'vocab-sharded' if vocab_sharded else 'replicated'} embedding, foreach={foreach}"
            )
            results[name] = StepResult(
                loss.full_tensor().detach().cpu(),
                grads,
                updated,
                fwd_bwd,
                optimizer,
                grad_placements,
            )
    return results


@world_sizes(2, 4)
def test_llama_step_megatron_equals_one_device(world_size: int) -> None:
    want = _reference_step(SHAPES)
    results = run_on_ranks(_distributed_steps, world_size, world_size, timeout_s=240)
    for rank, per_variant in enumerate(results):
        for variant, got in per_variant.items():
            where = f"rank {rank}, {variant}"
            assert got.fallbacks_fwd_bwd == {}, f"{where}: ops fell back: {got.fallbacks_fwd_bwd}"
            assert_close_to_scale(got.loss, want.loss, rel=1e-5, what=f"{where}: loss")
            assert got.grads.keys() == want.grads.keys()
            for k in want.grads:
                assert_close_to_scale(got.grads[k], want.grads[k], what=f"{where}: grad of {k}")
            stepped = _reference_adamw_given(got.grads, SHAPES)
            for k, v in stepped.items():
                assert_close_to_scale(got.updated[k], v, rel=1e-6, what=f"{where}: {k} after AdamW")
            placements = megatron_placements(SHAPES, vocab_sharded_embedding="vocab" in variant)
            for k, p in placements.items():
                if isinstance(p, Shard):  # a sharded weight's gradient stays sharded like it
                    assert got.grad_placements[k] == (p,), (
                        f"{where}: grad of {k}: {got.grad_placements[k]}"
                    )

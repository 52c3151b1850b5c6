"""A small single-device Llama-style model: the shared math and weights every bench implementation runs.

Attention is written as explicit ``matmul`` + causal ``softmax`` (no
``scaled_dot_product_attention``): torch's DTensor has no CPU sharding rule for the fused
SDPA kernels in some versions, and every implementation must run exactly the same math.
RoPE is off. Module and parameter names follow TorchTitan (``layers.0.attention.wq.weight``)
so tensor-parallel plans written for TorchTitan read naturally here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shapes of the bench model and its batch.

    Example:
        >>> LlamaConfig(dim=128).head_dim
        16
    """

    vocab: int = 512
    dim: int = 128
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 0  # 0: Llama's SwiGLU width, 8/3 * dim rounded up to a multiple of 32
    n_layers: int = 4
    seq: int = 64
    batch: int = 2
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``dim // n_heads``)."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: ``ffn_dim`` if set, else 8/3 * dim rounded up to a multiple of 32."""
        if self.ffn_dim > 0:
            return self.ffn_dim
        return 32 * math.ceil(8 * self.dim / 3 / 32)

    def check_tensor_parallel(self, world_size: int) -> None:
        """Raise if the heads or the MLP width cannot be split evenly over ``world_size`` ranks.

        Example:
            >>> LlamaConfig(n_heads=8, n_kv_heads=4).check_tensor_parallel(4)
        """
        for name, size in (
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("hidden_dim", self.hidden_dim),
        ):
            if size % world_size != 0:
                raise ValueError(
                    f"LlamaConfig: {name}={size} is not divisible by the tensor-parallel "
                    f"world size {world_size}"
                )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim.

    Example:
        >>> rms_norm(torch.ones(2, 4), torch.ones(4), 1e-5).shape
        torch.Size([2, 4])
    """
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention on ``[batch, seq, heads, head_dim]`` tensors.

    ``k``/``v`` may have fewer heads than ``q`` (each kv head serves consecutive q heads).
    Returns ``[batch, seq, heads * head_dim]``.

    Example:
        >>> causal_attention(torch.ones(1, 3, 4, 2), torch.ones(1, 3, 2, 2), torch.ones(1, 3, 2, 2)).shape
        torch.Size([1, 3, 8])
    """
    batch, seq, n_heads, head_dim = q.shape
    n_rep = n_heads // k.shape[2]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.transpose(1, 2).reshape(batch, seq, -1)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention. Head counts come from the tensor widths (``view(..., -1, head_dim)``),
    so the same code runs on full tensors and on a rank's head shard."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out: torch.Tensor = self.wo(causal_attention(q, k, v))
        return out


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    """Embedding, ``n_layers`` blocks, final RMSNorm and output projection; returns logits.

    Example:
        >>> cfg = LlamaConfig(vocab=32, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, seq=4, batch=1)
        >>> model = Llama(cfg)
        >>> _ = model.load_state_dict(make_full_weights(cfg, seed=0))
        >>> model(torch.zeros(1, 4, dtype=torch.long)).shape
        torch.Size([1, 4, 32])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def weight_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every parameter, keyed by its ``state_dict`` name.

    Example:
        >>> weight_shapes(LlamaConfig(n_layers=1))["layers.0.attention.wk.weight"]
        (64, 128)
    """
    kv_width = cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.vocab, cfg.dim)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (cfg.dim,)
        shapes[p + "attention.wq.weight"] = (cfg.n_heads * cfg.head_dim, cfg.dim)
        shapes[p + "attention.wk.weight"] = (kv_width, cfg.dim)
        shapes[p + "attention.wv.weight"] = (kv_width, cfg.dim)
        shapes[p + "attention.wo.weight"] = (cfg.dim, cfg.n_heads * cfg.head_dim)
        shapes[p + "ffn_norm.weight"] = (cfg.dim,)
        shapes[p + "feed_forward.w1.weight"] = (cfg.hidden_dim, cfg.dim)
        shapes[p + "feed_forward.w2.weight"] = (cfg.dim, cfg.hidden_dim)
        shapes[p + "feed_forward.w3.weight"] = (cfg.hidden_dim, cfg.dim)
    shapes["norm.weight"] = (cfg.dim,)
    shapes["output.weight"] = (cfg.vocab, cfg.dim)
    return shapes


def make_full_weights(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic full float32 weights (name -> tensor); every implementation shards these.

    Matrices are N(0, 1/fan_in); norm scales are 1 + N(0, 0.1) so their gradients are not trivial.

    Example:
        >>> cfg = LlamaConfig(n_layers=1)
        >>> torch.equal(make_full_weights(cfg, 3)["output.weight"], make_full_weights(cfg, 3)["output.weight"])
        True
    """
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 1:
            weights[name] = 1.0 + 0.1 * noise
        else:
            weights[name] = noise / math.sqrt(shape[-1])
    return weights


def make_batch(cfg: LlamaConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic ``(tokens, targets)``, each ``[batch, seq]`` int64.

    Example:
        >>> make_batch(LlamaConfig(batch=2, seq=8), seed=0)[0].shape
        torch.Size([2, 8])
    """
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``[batch, seq, vocab]`` logits against ``[batch, seq]`` targets.

    Example:
        >>> float(cross_entropy_loss(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)))  # log(4)
        1.3862943649291992
    """
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def loss_and_grads(
    cfg: LlamaConfig,
    full_weights: Mapping[str, torch.Tensor],
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-device reference: the loss and the full gradient of every weight.

    Example:
        >>> cfg = LlamaConfig(vocab=32, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, seq=4, batch=1)
        >>> loss, grads = loss_and_grads(cfg, make_full_weights(cfg, 0), *make_batch(cfg, 0))
        >>> grads["output.weight"].shape
        torch.Size([32, 16])
    """
    model = Llama(cfg)
    model.load_state_dict(dict(full_weights))
    loss = cross_entropy_loss(model(tokens), targets)
    torch.autograd.backward(loss)
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"loss_and_grads: parameter {name} received no gradient")
        grads[name] = param.grad.detach().clone()
    return loss.detach(), grads

"""Qwen3's decoder layer: attention with per-head q/k RMSNorm, then a SwiGLU MLP or an MoE.

The attention differs from :class:`~hyper_parallel.dmodule.layers.Attention` in two ways
that transformers' ``Qwen3Attention`` has: each query and key head is RMS-normalised over
``head_dim`` before the rotary embedding, and ``head_dim`` is its own field (Qwen3's
``head_dim``), not ``dim / n_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule.layers import (
    FeedForward,
    Linear,
    MoE,
    RMSNorm,
    TransformerBlock,
    apply_rotary,
    block_sharding,
    rotary_tables,
)
from hyper_parallel.dmodule.models._sharding import check_head_sizes
from hyper_parallel.dmodule.module import Module

__all__ = ["Qwen3Attention", "Qwen3Block"]

_ROPE_BUFFERS = ("rope_cos", "rope_sin")


class Qwen3Attention(Module):
    """Causal GQA with q/k RMSNorm per head before RoPE; heads split over ``tp``.

    ``wq``/``wk``/``wv`` are column parallel and ``wo`` row parallel (each ``tp`` rank owns
    ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value heads); ``q_norm``/``k_norm``
    weights (``head_dim`` long) are replicated and get their gradients summed over ``tp``.
    The same forward runs on DTensors or, as a ``local_map`` region (qwen3-ref's
    ``use_local_map``), on this rank's heads as plain tensors.

    Example::

        >>> attn = Qwen3Attention.Config(dim=16, n_heads=4, n_kv_heads=2, head_dim=8,
        ...                              max_seq_len=8).build()
        >>> attn.init_states()
        >>> attn(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim``, ``n_heads``, ``n_kv_heads`` (None: ``n_heads``), ``head_dim`` (None:
        ``dim / n_heads``), ``max_seq_len``, ``rope_theta`` and the q/k norms' ``norm_eps``.

        Example::

            >>> Qwen3Attention.Config(dim=16, n_heads=2, head_dim=4).q_width
            8
        """

        dim: int = 64
        n_heads: int = 4
        n_kv_heads: int | None = None
        head_dim: int | None = None
        max_seq_len: int = 128
        rope_theta: float = 1000000.0
        norm_eps: float = 1e-6
        sharding_config = block_sharding(replicated_states=_ROPE_BUFFERS)

        def validate(self) -> None:
            """Sizes are ints >= 1, the head counts divide and ``head_dim`` is even."""
            Module.Config.validate(self)
            require_positive(self, "dim", "n_heads", "n_kv_heads", "max_seq_len")
            require_positive_float(self, "rope_theta", "norm_eps")
            check_head_sizes(self, dim_path="head_dim")
            if self.head_size % 2:
                raise ConfigError(
                    f"expected an even head_dim for rotary embeddings, found {self.head_size}",
                    path="head_dim",
                )

        @property
        def kv_heads(self) -> int:
            """``n_kv_heads``, or ``n_heads`` when it is None."""
            return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

        @property
        def head_size(self) -> int:
            """``head_dim``, or ``dim / n_heads`` when it is None."""
            return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

        @property
        def q_width(self) -> int:
            """Output width of ``wq`` (``n_heads * head_dim``)."""
            return self.n_heads * self.head_size

    def __init__(self, config: Qwen3Attention.Config) -> None:
        super().__init__()
        config.validate()  # again: a config's fields may have been set after it was made
        self.config = config
        self.head_dim = config.head_size
        q_width, kv_width = config.q_width, config.kv_heads * self.head_dim
        self.wq = Linear.Config.colwise(config.dim, q_width, states_only=True).build()
        self.wk = Linear.Config.colwise(config.dim, kv_width, states_only=True).build()
        self.wv = Linear.Config.colwise(config.dim, kv_width, states_only=True).build()
        self.wo = Linear.Config.rowwise(q_width, config.dim, states_only=True).build()
        self.q_norm = RMSNorm.Config(dim=self.head_dim, eps=config.norm_eps).build()
        self.k_norm = RMSNorm.Config(dim=self.head_dim, eps=config.norm_eps).build()
        cos, sin = rotary_tables(self.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.wq.weight.device
        cos, sin = rotary_tables(
            self.head_dim, self.config.max_seq_len, self.config.rope_theta, device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over ``x`` of shape ``(batch, seq, dim)``."""
        batch, seq, _ = x.shape
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"Qwen3Attention: sequence length {seq} exceeds max_seq_len "
                f"{self.config.max_seq_len}"
            )
        # the norms act per head (over head_dim), before the rotation, as transformers' Qwen3
        q = self.q_norm(self.wq(x).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        heads, kv_heads = q.shape[1], k.shape[1]
        cos, sin = self.get_buffer("rope_cos")[:seq], self.get_buffer("rope_sin")[:seq]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if heads != kv_heads:
            k, v = _repeat_kv(k, heads // kv_heads), _repeat_kv(v, heads // kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, kv, s, d)`` → ``(b, kv * n_rep, s, d)``, each key/value head serving ``n_rep`` queries."""
    b, kv, s, d = x.shape
    return x.unsqueeze(2).expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Qwen3Block(TransformerBlock):
    """``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``; the MLP dense or MoE.

    :class:`~hyper_parallel.dmodule.layers.TransformerBlock` (its forward and parts) with
    Qwen3's attention and a feed-forward that may be a mixture of experts. Its parts declare
    their shardings (chosen in ``models/qwen3_sharding.py``); with ``region_blocks`` a dense
    block declares one too, an outer ``local_map`` region around them.

    Example::

        >>> block = Qwen3Block.Config(
        ...     attention=Qwen3Attention.Config(dim=16, n_heads=4, max_seq_len=8),
        ...     feed_forward=FeedForward.Config(dim=16, hidden_dim=32),
        ...     attention_norm=RMSNorm.Config(dim=16), ffn_norm=RMSNorm.Config(dim=16)).build()
        >>> block.init_states()
        >>> block(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """The four parts' configs.

        Example::

            >>> Qwen3Block.Config().attention.n_heads
            4
        """

        attention: Qwen3Attention.Config = Qwen3Attention.Config()  # noqa: RUF009 - copied per instance
        feed_forward: FeedForward.Config | MoE.Config = FeedForward.Config()  # noqa: RUF009 - copied per instance
        attention_norm: RMSNorm.Config = RMSNorm.Config()  # noqa: RUF009 - copied per instance
        ffn_norm: RMSNorm.Config = RMSNorm.Config()  # noqa: RUF009 - copied per instance

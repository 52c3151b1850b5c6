"""TransformerBlock: pre-norm attention and SwiGLU feed-forward with residual connections."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyper_parallel.dmodule.context_parallel import TokenLayout
from hyper_parallel.dmodule.layers.attention import Attention
from hyper_parallel.dmodule.layers.feed_forward import FeedForward
from hyper_parallel.dmodule.layers.norm import RMSNorm
from hyper_parallel.dmodule.module import Module

__all__ = ["TransformerBlock"]


class TransformerBlock(Module):
    """``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    The block declares no sharding of its own: its parts do (llama-ref's are chosen in
    ``models/llama_sharding.py``).

    Example::

        >>> from hyper_parallel.dmodule.layers import Attention, FeedForward, RMSNorm
        >>> cfg = TransformerBlock.Config(
        ...     attention=Attention.Config(dim=16, n_heads=4, max_seq_len=8),
        ...     feed_forward=FeedForward.Config(dim=16, hidden_dim=32),
        ...     attention_norm=RMSNorm.Config(dim=16), ffn_norm=RMSNorm.Config(dim=16))
        >>> block = cfg.build()
        >>> block.init_states()
        >>> block(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """The four parts' configs.

        Example::

            >>> TransformerBlock.Config().attention.n_heads
            4
        """

        attention: Attention.Config = Attention.Config()  # noqa: RUF009 - copied per instance
        feed_forward: FeedForward.Config = FeedForward.Config()  # noqa: RUF009 - copied per instance
        attention_norm: RMSNorm.Config = RMSNorm.Config()  # noqa: RUF009 - copied per instance
        ffn_norm: RMSNorm.Config = RMSNorm.Config()  # noqa: RUF009 - copied per instance

    def __init__(self, config: TransformerBlock.Config) -> None:
        super().__init__()
        self.config = config
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()

    def forward(self, x: torch.Tensor, *, layout: TokenLayout | None = None) -> torch.Tensor:
        """One pre-norm residual block over ``x`` of shape ``(batch, seq, dim)``.

        ``layout`` (packed documents, context parallelism) goes to the attention.
        """
        normed = self.attention_norm(x)
        attended = (
            self.attention(normed) if layout is None else self.attention(normed, layout=layout)
        )
        h = x + attended
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

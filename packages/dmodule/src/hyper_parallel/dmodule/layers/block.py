"""TransformerBlock: pre-norm attention and SwiGLU feed-forward with residual connections."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyper_parallel.dmodule.layers.attention import Attention
from hyper_parallel.dmodule.layers.feed_forward import FeedForward
from hyper_parallel.dmodule.layers.norm import RMSNorm
from hyper_parallel.dmodule.module import Module

__all__ = ["TransformerBlock"]


class TransformerBlock(Module):
    """``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    The block declares no sharding of its own: its parts do.

    Example::

        >>> cfg = TransformerBlock.Config.llama(dim=16, n_heads=4, ffn_dim=32, max_seq_len=8)
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

        @classmethod
        def llama(
            cls,
            *,
            dim: int,
            n_heads: int,
            ffn_dim: int,
            max_seq_len: int,
            n_kv_heads: int | None = None,
            norm_eps: float = 1e-6,
            rope_theta: float = 10000.0,
            use_rope: bool = True,
            local_map: bool = False,
            sequence_parallel: bool = False,
        ) -> TransformerBlock.Config:
            """A Llama block, tensor parallel over ``tp`` (``local_map``/``sequence_parallel`` variants).

            Example::

                >>> TransformerBlock.Config.llama(dim=16, n_heads=4, ffn_dim=32,
                ...                               max_seq_len=8).feed_forward.hidden_dim
                32
            """
            if sequence_parallel:
                norm = RMSNorm.Config.sequence_parallel(dim, eps=norm_eps)
            elif local_map:
                norm = RMSNorm.Config.local_map(dim, eps=norm_eps)
            else:
                norm = RMSNorm.Config(dim=dim, eps=norm_eps)
            return cls(
                attention=Attention.Config.tensor_parallel(
                    local_map=local_map,
                    sequence_parallel=sequence_parallel,
                    dim=dim,
                    n_heads=n_heads,
                    n_kv_heads=n_kv_heads,
                    max_seq_len=max_seq_len,
                    rope_theta=rope_theta,
                    use_rope=use_rope,
                ),
                feed_forward=FeedForward.Config.tensor_parallel(
                    local_map=local_map,
                    sequence_parallel=sequence_parallel,
                    dim=dim,
                    hidden_dim=ffn_dim,
                ),
                attention_norm=norm,
                ffn_norm=norm.replace(),
            )

    def __init__(self, config: TransformerBlock.Config) -> None:
        super().__init__()
        self.config = config
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One pre-norm residual block over ``x`` of shape ``(batch, seq, dim)``."""
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

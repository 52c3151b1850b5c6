"""SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``, hidden units sharded over ``tp``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_parallel.dmodule._checks import require_positive
from hyper_parallel.dmodule.layers._common import block_sharding
from hyper_parallel.dmodule.layers.linear import Linear
from hyper_parallel.dmodule.module import Module

__all__ = ["FeedForward"]


class FeedForward(Module):
    """SwiGLU MLP; ``w1``/``w3`` column parallel, ``w2`` row parallel (one all-reduce forward).

    ``sharding_config=block_sharding(local_map=True)`` runs it on plain local tensors.

    Example::

        >>> ffn = FeedForward.Config(dim=8, hidden_dim=16).build()
        >>> ffn.init_states()
        >>> ffn(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim`` and ``hidden_dim``.

        Example::

            >>> FeedForward.Config.tensor_parallel(local_map=True, dim=8).sharding_config.local_map
            LocalMapConfig(in_grad_placements=({MeshAxisName.TP: Partial(reduce_op='sum')},))
        """

        dim: int = 64
        hidden_dim: int = 256
        sharding_config = block_sharding()

        def validate(self) -> None:
            """Sizes are ints >= 1 (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "dim", "hidden_dim")

        @classmethod
        def tensor_parallel(
            cls, *, local_map: bool = False, sequence_parallel: bool = False, **fields: object
        ) -> FeedForward.Config:
            """A config with the tensor-parallel sharding of the given variant.

            Example::

                >>> FeedForward.Config.tensor_parallel(dim=8, hidden_dim=32).hidden_dim
                32
            """
            sharding = block_sharding(local_map=local_map, sequence_parallel=sequence_parallel)
            return cls(sharding_config=sharding, **fields)  # type: ignore[arg-type]

    def __init__(self, config: FeedForward.Config) -> None:
        super().__init__()
        self.config = config
        self.w1 = Linear.Config.colwise(config.dim, config.hidden_dim, states_only=True).build()
        self.w3 = Linear.Config.colwise(config.dim, config.hidden_dim, states_only=True).build()
        self.w2 = Linear.Config.rowwise(config.hidden_dim, config.dim, states_only=True).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``w2(silu(w1(x)) * w3(x))``."""
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out

"""Embedding: token lookup, with a vocab-parallel preset (rows of the table sharded over ``tp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hyper_parallel.dmodule._checks import require_positive
from hyper_parallel.dmodule.layers._common import (
    TP,
    replicated,
    sequence_sharded,
    standard_normal_init,
)
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dtensor import Shard

__all__ = ["Embedding"]


class Embedding(Module):
    """A lookup table ``weight[tokens]``; ``Embedding.Config.vocab_parallel`` shards the vocab.

    Example::

        >>> emb = Embedding.Config(num_embeddings=10, embedding_dim=4).build()
        >>> emb.init_states()
        >>> emb(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 4])
    """

    #: A lookup table: no FLOPs in ``BaseModel.Config.get_nparams_and_flops`` (as ``nn.Embedding``).
    is_embedding: ClassVar[bool] = True

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``num_embeddings`` (vocab size) and ``embedding_dim``; weights N(0, 1).

        Example::

            >>> Embedding.Config.vocab_parallel(1000, 64).sharding_config.state_shardings
            {'weight': {MeshAxisName.TP: Shard(dim=0)}}
        """

        num_embeddings: int = 256
        embedding_dim: int = 64
        param_init = {"weight": standard_normal_init}  # noqa: RUF012 - becomes a field

        def validate(self) -> None:
            """Sizes are ints >= 1 (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "num_embeddings", "embedding_dim")

        @classmethod
        def vocab_parallel(
            cls, num_embeddings: int, embedding_dim: int, *, sequence_parallel: bool = False
        ) -> Embedding.Config:
            """Vocab parallel: rows ``Shard(0)``; each rank looks up its rows, partial sums → ``Replicate``.

            Tokens are replicated over ``tp``. Tokens outside a rank's rows give zeros
            there, so the output starts ``Partial`` and is all-reduced (reduce-scattered
            to sequence shards ``Shard(1)`` when ``sequence_parallel``).

            Example::

                >>> cfg = Embedding.Config.vocab_parallel(1000, 64, sequence_parallel=True)
                >>> cfg.sharding_config.out_dst_shardings
                {MeshAxisName.TP: Shard(dim=1)}
            """
            return cls(
                num_embeddings=num_embeddings,
                embedding_dim=embedding_dim,
                sharding_config=ShardingConfig(
                    state_shardings={"weight": {TP: Shard(0)}},
                    in_src_shardings={"tokens": replicated()},
                    out_dst_shardings=sequence_sharded() if sequence_parallel else replicated(),
                ),
            )

        @classmethod
        def replicated(cls, num_embeddings: int, embedding_dim: int) -> Embedding.Config:
            """The whole table on every rank of ``tp``; tokens and output replicated.

            Example::

                >>> Embedding.Config.replicated(1000, 64).sharding_config.state_shardings
                {'weight': {MeshAxisName.TP: Replicate()}}
            """
            return cls(
                num_embeddings=num_embeddings,
                embedding_dim=embedding_dim,
                sharding_config=ShardingConfig(
                    state_shardings={"weight": replicated()},
                    in_src_shardings={"tokens": replicated()},
                ),
            )

    def __init__(self, config: Embedding.Config) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(config.num_embeddings, config.embedding_dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of ``weight`` for integer ``tokens``: shape ``(*tokens.shape, embedding_dim)``."""
        return F.embedding(tokens, self.weight)

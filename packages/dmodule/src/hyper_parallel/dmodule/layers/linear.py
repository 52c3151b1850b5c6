"""Linear: ``y = x @ weight.T + bias`` with column- and row-parallel presets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_parallel.dmodule._checks import require_positive
from hyper_parallel.dmodule.layers._common import TP, normal_init, replicated, sequence_sharded
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import NamedPlacement
from hyper_parallel.dtensor import Shard

__all__ = ["Linear"]


class Linear(Module):
    """A dense layer; ``Linear.Config.colwise``/``rowwise`` shard it over ``tp``.

    Example::

        >>> layer = Linear.Config(in_features=8, out_features=4).build()
        >>> layer.init_states()
        >>> layer(torch.ones(2, 8)).shape
        torch.Size([2, 4])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``in_features``, ``out_features``, ``bias``; weights N(0, 0.02), bias zeros.

        Example::

            >>> Linear.Config.colwise(16, 32).sharding_config.out_dst_shardings
            {MeshAxisName.TP: Shard(dim=-1)}
        """

        in_features: int = 64
        out_features: int = 64
        bias: bool = False
        param_init = {"weight": normal_init, "bias": torch.nn.init.zeros_}  # noqa: RUF012 - becomes a field

        def validate(self) -> None:
            """Feature counts are ints >= 1 (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "in_features", "out_features")

        @classmethod
        def colwise(
            cls,
            in_features: int,
            out_features: int,
            *,
            bias: bool = False,
            sequence_parallel: bool = False,
            states_only: bool = False,
        ) -> Linear.Config:
            """Column parallel: weight ``Shard(0)`` on ``tp``; input replicated, output ``Shard(-1)``.

            ``sequence_parallel``: the input arrives as sequence shards ``Shard(1)`` and
            is all-gathered. ``states_only``: declare only the weight layout (for a
            projection inside a block that declares inputs and outputs, e.g. a
            ``local_map`` block).

            Example::

                >>> Linear.Config.colwise(16, 32).sharding_config.state_shardings
                {'weight': {MeshAxisName.TP: Shard(dim=0)}}
            """
            states: dict[str, NamedPlacement] = {"weight": {TP: Shard(0)}}
            if bias:
                states["bias"] = {TP: Shard(0)}
            if states_only:
                sharding = ShardingConfig(state_shardings=states)
            else:
                sharding = ShardingConfig(
                    state_shardings=states,
                    in_src_shardings={"x": sequence_sharded()} if sequence_parallel else None,
                    in_dst_shardings={"x": replicated()},
                    out_dst_shardings={TP: Shard(-1)},
                )
            return cls(
                in_features=in_features,
                out_features=out_features,
                bias=bias,
                sharding_config=sharding,
            )

        @classmethod
        def rowwise(
            cls,
            in_features: int,
            out_features: int,
            *,
            bias: bool = False,
            sequence_parallel: bool = False,
            states_only: bool = False,
        ) -> Linear.Config:
            """Row parallel: weight ``Shard(1)``; input ``Shard(-1)``; ``Partial`` output → ``Replicate``.

            ``sequence_parallel``: the partial sums are reduce-scattered to sequence
            shards ``Shard(1)`` instead of all-reduced. The bias is replicated and added
            once. ``states_only``: as in :meth:`colwise`.

            Example::

                >>> Linear.Config.rowwise(32, 16).sharding_config.in_dst_shardings
                {'x': {MeshAxisName.TP: Shard(dim=-1)}}
            """
            states: dict[str, NamedPlacement] = {"weight": {TP: Shard(1)}}
            if bias:
                states["bias"] = replicated()
            if states_only:
                sharding = ShardingConfig(state_shardings=states)
            else:
                sharding = ShardingConfig(
                    state_shardings=states,
                    in_dst_shardings={"x": {TP: Shard(-1)}},
                    out_dst_shardings=sequence_sharded() if sequence_parallel else replicated(),
                )
            return cls(
                in_features=in_features,
                out_features=out_features,
                bias=bias,
                sharding_config=sharding,
            )

        @classmethod
        def replicated(
            cls, in_features: int, out_features: int, *, bias: bool = False
        ) -> Linear.Config:
            """The whole weight on every rank of ``tp``: a replicated input gives a replicated output.

            Example::

                >>> Linear.Config.replicated(16, 32).sharding_config.state_shardings
                {'weight': {MeshAxisName.TP: Replicate()}}
            """
            states: dict[str, NamedPlacement] = {"weight": replicated()}
            if bias:
                states["bias"] = replicated()
            return cls(
                in_features=in_features,
                out_features=out_features,
                bias=bias,
                sharding_config=ShardingConfig(
                    state_shardings=states, in_dst_shardings={"x": replicated()}
                ),
            )

    def __init__(self, config: Linear.Config) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(config.out_features, config.in_features))
        self.bias: torch.nn.Parameter | None
        if config.bias:
            self.bias = torch.nn.Parameter(torch.empty(config.out_features))
        else:
            self.register_parameter("bias", None)

    @property
    def in_features(self) -> int:
        """The input feature count, as ``nn.Linear.in_features`` (a plain input is checked against it)."""
        return self.config.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T (+ bias)``."""
        return F.linear(x, self.weight, self.bias)

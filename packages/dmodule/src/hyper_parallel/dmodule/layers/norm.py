"""RMSNorm and LayerNorm over the last dimension, with a sequence-parallel preset."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule.layers._common import TP, replicated, sequence_sharded
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import NamedPlacement
from hyper_parallel.dtensor import Partial

__all__ = ["LayerNorm", "RMSNorm"]


def _local_norm_sharding(
    states: tuple[str, ...], sequence_parallel: bool = False
) -> ShardingConfig:
    """Replicated weights, the norm on plain local tensors (``local_map``).

    A handful of element-wise ops that need no communication, so no per-op dispatch.
    With ``sequence_parallel`` the activations are sequence shards ``Shard(1)``: each
    rank's weight gradient then sums its own tokens only, so it is declared ``Partial``
    (``state_grad_placements``) and reduced once, where it accumulates.
    """
    layout = sequence_sharded() if sequence_parallel else replicated()
    partial: dict[str, NamedPlacement] = {name: {TP: Partial()} for name in states}
    return ShardingConfig(
        state_shardings={name: replicated() for name in states},
        in_dst_shardings={"x": layout},
        out_src_shardings=layout,
        local_map=LocalMapConfig(state_grad_placements=partial if sequence_parallel else {}),
    )


def _norm_sharding(states: tuple[str, ...], sequence_parallel: bool) -> ShardingConfig:
    """Weights replicated; with ``sequence_parallel`` the input and output stay sequence shards."""
    if not sequence_parallel:
        return ShardingConfig(state_shardings={name: replicated() for name in states})
    return ShardingConfig(
        state_shardings={name: replicated() for name in states},
        in_src_shardings={"x": sequence_sharded()},
        in_dst_shardings={"x": sequence_sharded()},
        out_dst_shardings=sequence_sharded(),
    )


class RMSNorm(Module):
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, computed in float32.

    Its weight is declared replicated over ``tp`` (every parameter of a parallelized
    model is a DTensor). ``RMSNorm.Config.sequence_parallel`` keeps the activations
    as sequence shards ``Shard(1)``: the norm is per token, so it needs no collective.

    Example::

        >>> norm = RMSNorm.Config(dim=4).build()
        >>> norm.init_states()
        >>> norm(torch.ones(2, 4)).shape
        torch.Size([2, 4])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim`` and ``eps``; the weight starts at ones.

        Example::

            >>> RMSNorm.Config(dim=8, eps=1e-5).eps
            1e-05
        """

        dim: int = 64
        eps: float = 1e-6
        param_init = {"weight": torch.nn.init.ones_}  # noqa: RUF012 - becomes a field
        sharding_config = _norm_sharding(("weight",), sequence_parallel=False)

        def validate(self) -> None:
            """``dim`` >= 1 and ``eps`` > 0 (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "dim")
            require_positive_float(self, "eps")

        @classmethod
        def sequence_parallel(cls, dim: int, *, eps: float = 1e-6) -> RMSNorm.Config:
            """Sequence parallel: input and output ``Shard(1)`` (sequence) over ``tp``.

            Example::

                >>> RMSNorm.Config.sequence_parallel(8).sharding_config.out_dst_shardings
                {MeshAxisName.TP: Shard(dim=1)}
            """
            return cls(dim=dim, eps=eps, sharding_config=_norm_sharding(("weight",), True))

        @classmethod
        def local_map(
            cls, dim: int, *, eps: float = 1e-6, sequence_parallel: bool = False
        ) -> RMSNorm.Config:
            """The norm on local tensors: no per-op dispatch, same numbers.

            Replicated activations, or sequence shards ``Shard(1)`` with
            ``sequence_parallel`` (the weight's local gradient then declared ``Partial``).

            Example::

                >>> RMSNorm.Config.local_map(8).sharding_config.local_map is not None
                True
                >>> RMSNorm.Config.local_map(8, sequence_parallel=True).sharding_config.in_dst_shardings
                {'x': {MeshAxisName.TP: Shard(dim=1)}}
            """
            sharding = _local_norm_sharding(("weight",), sequence_parallel)
            return cls(dim=dim, eps=eps, sharding_config=sharding)

    def __init__(self, config: RMSNorm.Config) -> None:
        super().__init__()
        self.config = config
        self.eps = config.eps
        self.weight = torch.nn.Parameter(torch.empty(config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LayerNorm(Module):
    """``F.layer_norm`` over the last dimension with a weight and a bias (both replicated).

    Example::

        >>> norm = LayerNorm.Config(dim=4).build()
        >>> norm.init_states()
        >>> norm(torch.randn(2, 4)).shape
        torch.Size([2, 4])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """``dim`` and ``eps``; weight ones, bias zeros.

        Example::

            >>> LayerNorm.Config(dim=8).eps
            1e-05
        """

        dim: int = 64
        eps: float = 1e-5
        param_init = {"weight": torch.nn.init.ones_, "bias": torch.nn.init.zeros_}  # noqa: RUF012 - becomes a field
        sharding_config = _norm_sharding(("weight", "bias"), sequence_parallel=False)

        def validate(self) -> None:
            """``dim`` >= 1 and ``eps`` > 0 (a ``ConfigError`` naming the field)."""
            Module.Config.validate(self)
            require_positive(self, "dim")
            require_positive_float(self, "eps")

        @classmethod
        def sequence_parallel(cls, dim: int, *, eps: float = 1e-5) -> LayerNorm.Config:
            """Sequence parallel: input and output ``Shard(1)`` (sequence) over ``tp``.

            Example::

                >>> LayerNorm.Config.sequence_parallel(8).sharding_config.in_dst_shardings
                {'x': {MeshAxisName.TP: Shard(dim=1)}}
            """
            return cls(dim=dim, eps=eps, sharding_config=_norm_sharding(("weight", "bias"), True))

    def __init__(self, config: LayerNorm.Config) -> None:
        super().__init__()
        self.config = config
        self.eps = config.eps
        self.weight = torch.nn.Parameter(torch.empty(config.dim))
        self.bias = torch.nn.Parameter(torch.empty(config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

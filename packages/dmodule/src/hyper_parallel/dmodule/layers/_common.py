"""Shared pieces of the TP-ready layers: the default initializer and the block sharding preset."""

from __future__ import annotations

import torch

from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.dtensor import Partial, Replicate, Shard

__all__ = [
    "TP",
    "block_sharding",
    "normal_init",
    "replicated",
    "sequence_sharded",
    "standard_normal_init",
]

TP = MeshAxisName.TP


def normal_init(tensor: torch.Tensor) -> torch.Tensor:
    """N(0, 0.02) in place: the initializer of every projection.

    Fan-in free, so a sharded weight initialises exactly like the full one; a module-level
    function (not a ``functools.partial``), so a config holding it round-trips through
    ``to_dict``/``from_dict`` to an equal config.

    Example::

        >>> normal_init(torch.empty(3)).shape
        torch.Size([3])
    """
    return torch.nn.init.normal_(tensor, mean=0.0, std=0.02)


def standard_normal_init(tensor: torch.Tensor) -> torch.Tensor:
    """N(0, 1) in place (``nn.Embedding``'s default), as a round-trippable function.

    Example::

        >>> standard_normal_init(torch.empty(3)).shape
        torch.Size([3])
    """
    return torch.nn.init.normal_(tensor, mean=0.0, std=1.0)


def replicated() -> NamedPlacement:
    """The layout "the same full tensor on every rank of ``tp``".

    Example::

        >>> replicated()
        {MeshAxisName.TP: Replicate()}
    """
    return {TP: Replicate()}


def sequence_sharded() -> NamedPlacement:
    """The sequence-parallel activation layout: ``(batch, seq, dim)`` split along ``seq``.

    Example::

        >>> sequence_sharded()
        {MeshAxisName.TP: Shard(dim=1)}
    """
    return {TP: Shard(1)}


def block_sharding(
    *,
    local_map: bool = False,
    sequence_parallel: bool = False,
    replicated_states: tuple[str, ...] = (),
) -> ShardingConfig:
    """The sharding of a column-then-row parallel block (Attention, FeedForward).

    The block receives ``x`` replicated over ``tp`` (all-gathered from the sequence
    shards when ``sequence_parallel``) and returns the row-parallel partial sums
    reduced to ``Replicate`` (or reduce-scattered to sequence shards). Its projections
    declare only their weights' layouts. With ``local_map`` the forward runs on plain
    local tensors: the output is declared ``Partial`` (``out_src``) and the gradient of
    ``x`` is a partial sum over ``tp`` (``in_grad_placements``).
    ``replicated_states`` are buffers (e.g. RoPE tables) every rank holds in full.

    Example::

        >>> block_sharding(local_map=True).local_map is not None
        True
    """
    out: NamedPlacement = sequence_sharded() if sequence_parallel else replicated()
    states: dict[str, NamedPlacement] = {name: replicated() for name in replicated_states}
    if not local_map:
        return ShardingConfig(
            state_shardings=states,
            in_dst_shardings={"x": replicated()},
            out_dst_shardings=out,
        )
    return ShardingConfig(
        state_shardings=states,
        in_dst_shardings={"x": replicated()},
        out_src_shardings={TP: Partial()},
        out_dst_shardings=out,
        local_map=LocalMapConfig(in_grad_placements=({TP: Partial()},)),  # forward(x)
    )

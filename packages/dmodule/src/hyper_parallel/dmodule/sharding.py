"""ShardingConfig: how a module's states, inputs and outputs are laid out over a named mesh."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from hyper_parallel.config import check_fields, dataclass_from_dict, dataclass_to_dict
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement, axis_name
from hyper_parallel.dtensor import Placement, Replicate

__all__ = [
    "GradPlacements",
    "LocalMapConfig",
    "OutputShardings",
    "ShardingConfig",
    "resolve_placements",
]

_S = TypeVar("_S", "LocalMapConfig", "ShardingConfig")


class _DictData:
    """``to_dict``/``from_dict`` in hp-config's format, placements by the placement codec."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON data: placements as ``"Shard(0)"``, ``"Replicate()"``, ``"Partial(sum)"``.

        Example::

            >>> from hyper_parallel.dtensor import Shard
            >>> ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}}).to_dict()["state_shardings"]
            {'weight': {'tp': 'Shard(0)'}}
        """
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls: type[_S], data: dict[str, Any]) -> _S:
        """Rebuild from :meth:`to_dict` data (a ``ConfigError`` names a bad path).

        Example::

            >>> data = {"state_shardings": {"weight": {"tp": "Shard(0)"}}}
            >>> ShardingConfig.from_dict(data).state_shardings
            {'weight': {MeshAxisName.TP: Shard(dim=0)}}
        """
        return dataclass_from_dict(cls, data)


OutputShardings: TypeAlias = (
    NamedPlacement | Sequence[NamedPlacement | None] | Mapping[str, NamedPlacement | None]
)
"""One :data:`NamedPlacement` for every tensor output, or one per output of a tuple, list or dict."""

GradPlacements: TypeAlias = tuple[NamedPlacement | None, ...] | dict[str, NamedPlacement]
"""``in_grad_placements``: one entry per positional forward input (upstream's form), or by name."""


@dataclass(frozen=True, kw_only=True)
class LocalMapConfig(_DictData):
    """Run ``forward`` on local shards (no DTensor dispatch inside the block).

    ``in_grad_placements`` gives the placements an input's gradient has when it flows
    back out of the block (default: the placements the input was redistributed to,
    ``in_dst_shardings``). As upstream, a tuple with one entry per positional forward
    input, in order (``None`` where there is nothing to declare); or, an addition here, a
    dict by argument name. Declare ``Partial()`` for an input whose local gradient is a
    partial sum, e.g. the input of a column-parallel block that is replicated over ``tp``.

    ``state_grad_placements`` does the same for states (an addition here): a state path
    -> the placements of its local gradient when they are not the state's own, e.g.
    ``{"weight": {tp: Partial()}}`` for a replicated norm weight applied to sequence
    shards; the gradient is then reduced once, where it accumulates on the parameter.

    Example::

        >>> from hyper_parallel.dtensor import Partial
        >>> LocalMapConfig(in_grad_placements=({MeshAxisName.TP: Partial()},))
        LocalMapConfig(in_grad_placements=({MeshAxisName.TP: Partial(reduce_op='sum')},))
    """

    in_grad_placements: GradPlacements = ()
    compile: bool = False
    # state path -> the layout of its local gradient, when not the state's own: e.g.
    # ``{"weight": {tp: Partial()}}`` for a replicated norm weight used on sequence shards
    # (each rank's gradient sums its own tokens; it is reduced once, where it accumulates)
    state_grad_placements: dict[str, NamedPlacement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.in_grad_placements, list):  # upstream's annotation is a tuple
            object.__setattr__(self, "in_grad_placements", tuple(self.in_grad_placements))
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class ShardingConfig(_DictData):
    """Declared layouts of one module, by mesh axis name (unnamed axes replicate).

    - ``state_shardings``: parameter or buffer path (``"weight"``, ``"proj.bias"``) →
      placements; :meth:`Module.parallelize` turns those states into DTensors.
    - ``in_src_shardings``: forward argument → the layout a *plain* tensor argument has
      (it is wrapped with ``DTensor.from_local``).
    - ``in_dst_shardings``: forward argument → the layout ``forward`` receives (the input
      is redistributed to it; a plain tensor without ``in_src`` is taken to be in it).
    - ``out_src_shardings``: the layout of *plain* tensor outputs (wrapped with
      ``DTensor.from_local``); one :data:`NamedPlacement` for every tensor output, or a
      tuple/list/dict matching the output structure (``None`` leaves an output alone).
    - ``out_dst_shardings``: the layout outputs are redistributed to; same forms.
    - ``local_map``: run ``forward`` on local tensors (see :class:`LocalMapConfig`).

    Values are type-checked when it is made (a ``ConfigTypeError`` naming the field);
    ``to_dict``/``from_dict`` write placements as ``"Shard(0)"`` (see
    :data:`~hyper_parallel.dmodule.types.PLACEMENT_CODEC`).

    Example::

        >>> from hyper_parallel.dtensor import Shard
        >>> sc = ShardingConfig(
        ...     state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
        ...     in_dst_shardings={"x": {}},
        ...     out_dst_shardings={MeshAxisName.TP: Shard(-1)},
        ... )
        >>> sc.state_shardings["weight"]
        {MeshAxisName.TP: Shard(dim=0)}
    """

    state_shardings: dict[str, NamedPlacement] = field(default_factory=dict)
    in_src_shardings: dict[str, NamedPlacement] | None = None
    in_dst_shardings: dict[str, NamedPlacement] | None = None
    out_src_shardings: OutputShardings | None = None
    out_dst_shardings: OutputShardings | None = None
    local_map: LocalMapConfig | None = None

    def __post_init__(self) -> None:
        for name in ("out_src_shardings", "out_dst_shardings"):
            if isinstance(getattr(self, name), list):  # one canonical form, as from_dict reads it
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_fields(self)


def resolve_placements(
    named: NamedPlacement,
    mesh_axis_names: Sequence[str],
    *,
    where: str | None = None,
) -> list[Placement]:
    """One placement per mesh axis from placements named by axis; unnamed axes replicate.

    ``where`` prefixes errors (e.g. ``"Linear.weight"``).

    Example::

        >>> from hyper_parallel.dtensor import Replicate, Shard
        >>> resolve_placements({"tp": Shard(0)}, ("dp", "tp")) == [Replicate(), Shard(0)]
        True
    """
    prefix = where or "resolve_placements"
    axes = tuple(mesh_axis_names)
    if not isinstance(named, Mapping):
        raise TypeError(
            f"{prefix}: expected placements by mesh axis name (e.g. {{'tp': Shard(0)}}), "
            f"found {named!r}"
        )
    placements: list[Placement] = [Replicate()] * len(axes)
    for axis, placement in named.items():
        if not isinstance(axis, (str, MeshAxisName)):
            raise TypeError(
                f"{prefix}: expected a mesh axis name (str or MeshAxisName), found {axis!r}"
            )
        name = axis_name(axis)
        if name not in axes:
            raise ValueError(
                f"{prefix}: sharding_config names mesh axis {name!r}; mesh axes are {axes}"
            )
        if not isinstance(placement, Placement):
            raise TypeError(
                f"{prefix}: mesh axis {name!r}: expected a Placement (Shard, Replicate, "
                f"Partial), found {placement!r}"
            )
        placements[axes.index(name)] = placement
    return placements

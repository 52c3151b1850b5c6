"""Names of mesh axes and the named placements that refer to them."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TypeAlias

from hyper_parallel.dtensor import Placement

__all__ = ["MeshAxis", "MeshAxisName", "NamedPlacement", "axis_name"]


class MeshAxisName(str, Enum):
    """Conventional mesh axis names; a plain ``str`` key works wherever one of these does.

    Example::

        >>> MeshAxisName.TP == "tp", str(MeshAxisName.DP)
        (True, 'dp')
    """

    DP = "dp"
    TP = "tp"
    CP = "cp"
    EP = "ep"
    PP = "pp"

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return f"MeshAxisName.{self.name}"


MeshAxis: TypeAlias = "MeshAxisName | str"
"""A mesh axis named by a :class:`MeshAxisName` or a plain string."""

NamedPlacement: TypeAlias = (
    "Mapping[MeshAxisName, Placement] | Mapping[str, Placement] "
    "| Mapping[MeshAxisName | str, Placement]"
)
"""Placements by mesh axis name, e.g. ``{MeshAxisName.TP: Shard(0)}``; unnamed axes replicate.

(A union because ``Mapping`` is invariant in its key type: a ``dict[MeshAxisName, Shard]``
built ahead of time must fit as well as a ``dict[str, Replicate]``.)"""


def axis_name(axis: MeshAxis) -> str:
    """The plain string of a mesh axis name.

    Example::

        >>> axis_name(MeshAxisName.TP), axis_name("dp")
        ('tp', 'dp')
    """
    return str(axis.value) if isinstance(axis, MeshAxisName) else str(axis)


def is_named_placement(value: object) -> bool:
    """True when ``value`` is a mapping whose values are all placements (``{}`` included).

    Example::

        >>> from hyper_parallel.dtensor import Shard
        >>> is_named_placement({"tp": Shard(0)}), is_named_placement({"out": {"tp": Shard(0)}})
        (True, False)
    """
    return isinstance(value, Mapping) and all(isinstance(p, Placement) for p in value.values())

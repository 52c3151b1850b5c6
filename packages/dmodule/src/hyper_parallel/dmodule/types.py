"""Names of mesh axes and the named placements that refer to them."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from enum import Enum
from typing import Annotated, TypeAlias

from hyper_parallel.config import LeafCodec
from hyper_parallel.dtensor import Partial, Placement, Replicate, Shard

__all__ = [
    "PLACEMENT_CODEC",
    "MeshAxis",
    "MeshAxisName",
    "NamedPlacement",
    "Placement",
    "PlacementField",
    "StrEnum",
    "axis_name",
    "format_placement",
    "parse_placement",
]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised on Python 3.10 only

    class StrEnum(str, Enum):
        """Backport of Python 3.11's ``enum.StrEnum``: members are strings, ``str()`` is the value."""

        def __str__(self) -> str:
            return str(self.value)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list[str]) -> str:
            return name.lower()


class MeshAxisName(StrEnum):
    """Conventional mesh axis names (upstream's members); a plain ``str`` works wherever one does.

    Example::

        >>> MeshAxisName.TP == "tp", str(MeshAxisName.DP_SHARD), MeshAxisName("efsdp")
        (True, 'dp_shard', MeshAxisName.EFSDP)
    """

    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    FSDP = "fsdp"
    TP = "tp"
    CP = "cp"
    PP = "pp"
    EP = "ep"
    EFSDP = "efsdp"

    def __repr__(self) -> str:
        return f"MeshAxisName.{self.name}"


MeshAxis: TypeAlias = MeshAxisName | str
"""A mesh axis named by a :class:`MeshAxisName` or a plain string."""


_PLACEMENT_TEXT = re.compile(
    r"\s*(?P<kind>Shard|Replicate|Partial|S|R|P)\s*(?:\(\s*(?P<arg>[^()]*?)\s*\))?\s*"
)


def format_placement(placement: Placement) -> str:
    """The placement codec's text for ``placement``: ``"Shard(0)"``, ``"Replicate()"``, ``"Partial(max)"``.

    Example::

        >>> format_placement(Shard(-1)), format_placement(Partial())
        ('Shard(-1)', 'Partial(sum)')
    """
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial):
        return f"Partial({placement.reduce_op})"
    raise TypeError(f"expected Shard, Replicate or Partial, found {placement!r}")


def parse_placement(data: object) -> Placement:
    """A placement from the codec's text (what :func:`format_placement` writes, or its reprs).

    Accepted: ``Shard(0)``, ``Shard(dim=0)``, ``S(0)``; ``Replicate()``, ``Replicate``, ``R``;
    ``Partial()``, ``Partial(max)``, ``Partial('max')``, ``Partial(reduce_op='max')``, ``P``.

    Example::

        >>> parse_placement("Shard(dim=1)"), parse_placement("Partial('avg')")
        (Shard(dim=1), Partial(reduce_op='avg'))
    """
    if not isinstance(data, str):
        raise TypeError("a placement is written as a string")
    match = _PLACEMENT_TEXT.fullmatch(data)
    if match is None:
        raise ValueError("not a placement")
    kind, arg = match["kind"][0], (match["arg"] or "")
    arg = re.sub(r"^(dim|reduce_op)\s*=\s*", "", arg).strip("'\"")
    if kind == "S":
        if not re.fullmatch(r"[+-]?\d+", arg):
            raise ValueError("Shard needs an int tensor dimension")
        return Shard(int(arg))
    if kind == "R":
        if arg:
            raise ValueError("Replicate takes no argument")
        return Replicate()
    return Partial(arg) if arg else Partial()  # type: ignore[arg-type]  # Partial checks it


#: How ``to_dict``/``from_dict`` and dotted overrides write a placement: the string
#: ``"Shard(0)"``, ``"Replicate()"`` or ``"Partial(sum)"`` (see :func:`parse_placement`).
PLACEMENT_CODEC = LeafCodec(
    type=Placement,
    encode=format_placement,
    decode=parse_placement,
    expected="a placement such as 'Shard(0)', 'Replicate()' or 'Partial(sum)'",
)

PlacementField: TypeAlias = Annotated[Placement, PLACEMENT_CODEC]
"""A :class:`Placement` in a config: written by :data:`PLACEMENT_CODEC`."""

NamedPlacement: TypeAlias = (
    Mapping[MeshAxisName, PlacementField]
    | Mapping[str, PlacementField]
    | Mapping[MeshAxisName | str, PlacementField]
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

"""Output layouts of a parallelized forward: one for every output, or per element or key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast

from hyper_parallel.dmodule.sharding import OutputShardings, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement, is_named_placement
from hyper_parallel.dtensor import Placement

__all__ = ["EveryOutput", "OutputLayout", "OutputMap", "OutputSequence", "resolve_output_layout"]

Placements: TypeAlias = tuple[Placement, ...]


@dataclass(frozen=True)
class EveryOutput:
    """One layout for every tensor in the output, however nested."""

    placements: Placements


@dataclass(frozen=True)
class OutputSequence:
    """One layout (or ``None``: leave alone) per element of a tuple or list output."""

    items: tuple[OutputLayout | None, ...]


@dataclass(frozen=True)
class OutputMap:
    """One layout (or ``None``: leave alone) per key of a dict output."""

    items: dict[str, OutputLayout | None]


OutputLayout: TypeAlias = "EveryOutput | OutputSequence | OutputMap"


def resolve_output_layout(
    spec: OutputShardings, mesh_axis_names: Sequence[str], *, where: str
) -> OutputLayout:
    """Resolve ``out_src_shardings``/``out_dst_shardings`` against the mesh axes.

    A mapping whose values are placements is one layout for every tensor output;
    a tuple/list or a mapping of named placements (or ``None``) follows the output.

    Example::

        >>> from hyper_parallel.dtensor import Shard
        >>> resolve_output_layout({"tp": Shard(0)}, ("tp",), where="Linear.out")
        EveryOutput(placements=(Shard(dim=0),))
    """
    if is_named_placement(spec):
        named = cast("NamedPlacement", spec)
        return EveryOutput(tuple(resolve_placements(named, mesh_axis_names, where=where)))
    if isinstance(spec, Mapping):
        per_key = cast("Mapping[str, OutputShardings | None]", spec)
        return OutputMap(
            {
                str(key): None
                if item is None
                else resolve_output_layout(item, mesh_axis_names, where=f"{where}[{key!r}]")
                for key, item in per_key.items()
            }
        )
    if isinstance(spec, (tuple, list)):
        return OutputSequence(
            tuple(
                None
                if item is None
                else resolve_output_layout(item, mesh_axis_names, where=f"{where}[{i}]")
                for i, item in enumerate(spec)
            )
        )
    raise TypeError(
        f"{where}: expected placements by mesh axis name (e.g. {{'tp': Shard(0)}}), or a "
        f"tuple/list/dict of them matching the outputs, found {spec!r}"
    )

"""The resolved forward plan of a parallelized module: inputs in, outputs out."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import torch

from hyper_parallel.dmodule.sharding import OutputShardings, resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement, is_named_placement
from hyper_parallel.dtensor import DeviceMesh, DTensor, Placement, enforce_layout

__all__ = [
    "EveryOutput",
    "ForwardPlan",
    "OutputLayout",
    "OutputMap",
    "OutputSequence",
    "resolve_output_layout",
]

Placements: TypeAlias = tuple[Placement, ...]

_POSITIONAL_KINDS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_forward_signatures: dict[type, tuple[tuple[str, ...], frozenset[str], bool]] = {}


def forward_signature(cls: type) -> tuple[tuple[str, ...], frozenset[str], bool]:
    """``(positional names, all names, accepts **kwargs)`` of ``cls.forward``, cached per class.

    Example::

        >>> class Net(torch.nn.Module):
        ...     def forward(self, x, mask=None, *, scale=1.0): ...
        >>> positional, names, var_keyword = forward_signature(Net)
        >>> positional, sorted(names), var_keyword
        (('x', 'mask'), ['mask', 'scale', 'x'], False)
    """
    cached = _forward_signatures.get(cls)
    if cached is None:
        forward = cast("Callable[..., object]", getattr(cls, "forward"))  # noqa: B009
        params = list(inspect.signature(forward).parameters.values())[1:]  # drop self
        positional = tuple(p.name for p in params if p.kind in _POSITIONAL_KINDS)
        named = frozenset(
            p.name
            for p in params
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        )
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        cached = _forward_signatures[cls] = (positional, named, var_kw)
    return cached


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


@dataclass(frozen=True)
class ForwardPlan:
    """Everything a parallelized forward needs, resolved once by ``parallelize``.

    It holds no reference to the module (the module holds it), so no cycle forms.
    """

    owner: str
    mesh: DeviceMesh
    positional_names: tuple[str, ...]
    in_src: dict[str, Placements] = field(default_factory=dict)
    in_dst: dict[str, Placements] = field(default_factory=dict)
    out_src: OutputLayout | None = None
    out_dst: OutputLayout | None = None
    local_map: bool = False
    in_grad: dict[str, Placements] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardPlan:
        return self  # immutable; its mesh holds process groups, which cannot be copied

    # -- inputs ------------------------------------------------------------------------
    def prepare_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Wrap plain inputs (``in_src``), redistribute (``in_dst``), go local (local_map)."""
        if not (self.in_src or self.in_dst or self.local_map):
            return args, kwargs
        names = self.positional_names
        new_args = tuple(
            self._prepare_input(names[i] if i < len(names) else None, value)
            for i, value in enumerate(args)
        )
        new_kwargs = {name: self._prepare_input(name, value) for name, value in kwargs.items()}
        return new_args, new_kwargs

    def _prepare_input(self, name: str | None, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        src = self.in_src.get(name) if name is not None else None
        dst = self.in_dst.get(name) if name is not None else None
        if not isinstance(value, DTensor):
            layout = src if src is not None else dst
            if layout is None:
                return value
            value = DTensor.from_local(value, self.mesh, layout)
        if dst is not None:
            # a declared input layout holds both ways: the gradient leaves the module in it too
            # (a Partial gradient is reduced once here, as Megatron's "copy to parallel region")
            value = enforce_layout(value, dst)
        if self.local_map:
            grad = self.in_grad.get(name) if name is not None else None
            return value.to_local(grad_placements=grad)
        return value

    # -- outputs -----------------------------------------------------------------------
    def finish_outputs(self, outputs: Any) -> Any:
        """Wrap plain outputs (``out_src``) and redistribute them (``out_dst``)."""
        if self.out_src is None and self.out_dst is None:
            return outputs
        return self._finish(outputs, self.out_src, self.out_dst, "output")

    def _finish(
        self, value: Any, src: OutputLayout | None, dst: OutputLayout | None, path: str
    ) -> Any:
        if isinstance(value, torch.Tensor):
            return self._finish_tensor(
                value, self._leaf(src, path, "out_src"), self._leaf(dst, path, "out_dst")
            )
        if isinstance(value, (tuple, list)):
            n = len(value)
            items = [
                self._finish(
                    item,
                    self._child(src, i, n, path, "out_src"),
                    self._child(dst, i, n, path, "out_dst"),
                    f"{path}[{i}]",
                )
                for i, item in enumerate(value)
            ]
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*items)  # a namedtuple
            return type(value)(items)
        if isinstance(value, dict):
            self._check_keys(src, value, path, "out_src")
            self._check_keys(dst, value, path, "out_dst")
            return type(value)(
                (
                    key,
                    self._finish(
                        item,
                        self._child(src, key, None, path, "out_src"),
                        self._child(dst, key, None, path, "out_dst"),
                        f"{path}[{key!r}]",
                    ),
                )
                for key, item in value.items()
            )
        return value

    def _finish_tensor(
        self, value: torch.Tensor, src: Placements | None, dst: Placements | None
    ) -> torch.Tensor:
        if not isinstance(value, DTensor):
            layout = src if src is not None else dst
            if layout is None:
                return value
            value = DTensor.from_local(value, self.mesh, layout)
        if dst is not None:
            value = value.redistribute(self.mesh, dst)
        return value

    def _leaf(self, layout: OutputLayout | None, path: str, kind: str) -> Placements | None:
        if layout is None or isinstance(layout, EveryOutput):
            return None if layout is None else layout.placements
        shape = "a tuple/list" if isinstance(layout, OutputSequence) else "a dict"
        raise TypeError(
            f"{self.owner}: {kind}_shardings is {shape} of layouts, but forward returned a "
            f"single tensor at {path}"
        )

    def _child(
        self, layout: OutputLayout | None, key: int | str, n: int | None, path: str, kind: str
    ) -> OutputLayout | None:
        if layout is None or isinstance(layout, EveryOutput):
            return layout
        if isinstance(layout, OutputSequence):
            if n is None or not isinstance(key, int):
                raise TypeError(
                    f"{self.owner}: {kind}_shardings is a tuple/list of {len(layout.items)} "
                    f"layouts, but forward returned a dict at {path}"
                )
            if len(layout.items) != n:
                raise ValueError(
                    f"{self.owner}: {kind}_shardings has {len(layout.items)} layouts, but "
                    f"forward returned {n} outputs at {path}"
                )
            return layout.items[key]
        if n is not None:
            raise TypeError(
                f"{self.owner}: {kind}_shardings is a dict of layouts, but forward returned "
                f"a tuple/list at {path}"
            )
        return layout.items.get(str(key))

    def _check_keys(
        self, layout: OutputLayout | None, value: dict[Any, Any], path: str, kind: str
    ) -> None:
        if isinstance(layout, OutputMap):
            missing = sorted(set(layout.items) - {str(k) for k in value})
            if missing:
                raise KeyError(
                    f"{self.owner}: {kind}_shardings names outputs {missing} that forward did "
                    f"not return at {path}; it returned keys {sorted(map(str, value))}"
                )

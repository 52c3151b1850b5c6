"""The resolved forward plan of a parallelized module: inputs in, outputs out."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import torch

from hyper_parallel.dmodule import _nested
from hyper_parallel.dmodule._nested import convert, input_conversion, output_conversion
from hyper_parallel.dmodule._output_layout import (
    EveryOutput,
    OutputLayout,
    OutputMap,
    OutputSequence,
    resolve_output_layout,
)
from hyper_parallel.dmodule.local_map import (
    InputStep,
    OutputStep,
    dtensor_states,
    enter_local,
    exit_local,
    local_states,
    local_views,
)
from hyper_parallel.dtensor import DeviceMesh, DTensor, Placement, Shard, enforce_layout
from hyper_parallel.dtensor.parallel import check_plain_shard_input

__all__ = [
    "EveryOutput",
    "ForwardPlan",
    "OutputLayout",
    "OutputMap",
    "OutputSequence",
    "compile_local_maps",
    "resolve_output_layout",
]

Placements: TypeAlias = tuple[Placement, ...]
LeafFn: TypeAlias = "Callable[[torch.Tensor, Placements | None, Placements | None], Any]"

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
    compile: bool = False
    # a linear's input features per input name: a plain input taken as a shard is checked
    in_features: dict[str, int] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardPlan:
        return self  # immutable; its mesh holds process groups, which cannot be copied

    # -- inputs ------------------------------------------------------------------------
    def prepare_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Wrap plain inputs (``in_src``), redistribute (``in_dst``), go local (local_map)."""
        if not (self.in_src or self.in_dst or self.local_map):
            return args, kwargs
        if _nested.depth:
            self._refuse_inside_region("in_src_shardings/in_dst_shardings")
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
            features = self.in_features.get(name) if name is not None else None
            if features is not None:
                value = self._linear_input(name, value, features, layout)
            else:
                value = DTensor.from_local(value, self.mesh, layout)
        if dst is not None:
            # a declared input layout holds both ways: the gradient leaves the module in it too
            # (a Partial gradient is reduced once here, as Megatron's "copy to parallel region")
            value = enforce_layout(value, dst)
        if self.local_map:
            grad = self.in_grad.get(name) if name is not None else None
            return value.to_local(grad_placements=grad)
        return value

    def _linear_input(
        self, name: str | None, value: torch.Tensor, features: int, layout: Placements
    ) -> DTensor:
        """A linear's plain input as a DTensor, after checking it is this rank's shard of it.

        When only the feature dim is sharded, the global shape is known (``features``),
        so uneven feature shards (``torch.chunk``'s sizes) wrap exactly.
        """
        check_plain_shard_input(
            value,
            features,
            self.mesh,
            layout,
            where=self.owner,
            fix=f"pass this rank's shard of {name!r}, a DTensor, or declare "
            f"in_src_shardings={{{name!r}: <Replicate on those axes>}} to pass the full input",
        )
        last = value.ndim - 1
        if value.ndim == 0 or any(isinstance(p, Shard) and p.dim not in (-1, last) for p in layout):
            return DTensor.from_local(value, self.mesh, layout)
        shape = (*value.shape[:-1], features)
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):  # contiguous strides of the global shape
            stride[d] = stride[d + 1] * shape[d + 1]
        return DTensor.from_local(value, self.mesh, layout, shape=shape, stride=tuple(stride))

    # -- a local_map call ---------------------------------------------------------------
    def call_local(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``forward(module, *args, **kwargs)`` on local inputs and states (``local_map``).

        With autograd recording, the inputs enter through one autograd node and the
        outputs leave through one (see :mod:`hyper_parallel.dmodule.local_map`), the
        states' local views are kept across calls while unchanged, and ``forward`` is
        the compiled one under ``LocalMapConfig(compile=True)``. Values, gradients and
        collectives are those of the unfused path (``prepare_inputs``, ``local_states``,
        ``finish_outputs``), which runs when autograd does not record.
        """
        if _nested.depth:  # called by a region's forward: an inner region, on plain tensors
            return self.call_inner(module, forward, args, kwargs)
        if self.compile:
            _warm_inner_regions(module)
            forward = _compiled_region(forward)
        if not torch.is_grad_enabled():
            args, kwargs = self.prepare_inputs(args, kwargs)
            with local_states(module):
                _nested.depth += 1
                try:
                    outputs = forward(module, *args, **kwargs)
                finally:
                    _nested.depth -= 1
            return self.finish_outputs(outputs)
        # Every call runs this: loops over the arguments and states are written so that
        # they make no Python call per item (exact-type checks first, no list methods).
        names = self.positional_names
        n_names = len(names)
        io = self._input_io
        steps: list[InputStep] = []
        values: list[torch.Tensor] = []
        where: list[int | str] = []
        for i, value in enumerate(args):
            t = type(value)
            if t is DTensor or t is torch.Tensor or isinstance(value, torch.Tensor):
                name = names[i] if i < n_names else None
                step = _input_step(io[name] if name in io else None, value)  # noqa: SIM401 (no call)
                if step is not None:
                    steps += (step,)
                    values += (value,)
                    where += (i,)
        if kwargs:
            for name, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    step = _input_step(io[name] if name in io else None, value)  # noqa: SIM401 (no call)
                    if step is not None:
                        steps += (step,)
                        values += (value,)
                        where += (name,)
        local_inputs, slots, views = enter_local(module, self.mesh, steps, values)
        if local_inputs:
            new_args, kwargs = list(args), dict(kwargs)
            for key, local in zip(where, local_inputs, strict=True):
                if type(key) is int:
                    new_args[key] = local
                else:
                    kwargs[key] = local  # type: ignore[index]  # a str (mypy narrows isinstance only)
            args = tuple(new_args)
        for (states, name, _), view in zip(slots, views, strict=True):  # swap_in, inline
            states[name] = view
        _nested.depth += 1
        try:
            outputs = forward(module, *args, **kwargs)
        finally:
            _nested.depth -= 1
            for states, name, state in slots:  # swap_back, inline
                states[name] = state
        return self._finish_local(outputs)

    # -- a local_map call inside another one (an inner region) ---------------------------
    def call_inner(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``forward`` on the plain local inputs an outer region's forward passes.

        No DTensor is built: each declared input and output is moved by
        :func:`~hyper_parallel.dmodule._nested.convert` (the boundary's collectives on the
        local tensor, their transposes on its gradient). States the outer region did not
        swap (a module outside its subtree) are taken local here, one node for all.
        """
        names = self.positional_names
        n_names = len(names)
        conversions = self._inner_inputs  # the declarations, checked before any collective
        todo: list[tuple[int | str, str, Any]] = []  # every input is checked before any moves
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                name = names[i] if i < n_names else None
                if type(value) is DTensor or isinstance(value, DTensor):
                    self._refuse_dtensor_input(name if name is not None else f"args[{i}]")
                conversion = conversions[name] if name in conversions else None  # noqa: SIM401 (no call)
                if conversion is not None:
                    todo += ((i, cast("str", name), conversion),)
        if kwargs:
            for name, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    if type(value) is DTensor or isinstance(value, DTensor):
                        self._refuse_dtensor_input(name)
                    conversion = conversions[name] if name in conversions else None  # noqa: SIM401 (no call)
                    if conversion is not None:
                        todo += ((name, name, conversion),)
        if todo:
            new_args, kwargs = list(args), dict(kwargs)
            for key, name, conversion in todo:
                if type(key) is int:
                    new_args[key] = convert(new_args[key], conversion, (self, name))
                else:
                    kwargs[name] = convert(kwargs[name], conversion, (self, name))
            args = tuple(new_args)
        if self.compile and not _nested.compiling:
            forward = _compiled_region(forward)
        slots = dtensor_states(module)
        views = local_views(module, slots) if slots else ()
        for (states, name, _), view in zip(slots, views, strict=True):
            states[name] = view
        _nested.depth += 1
        try:
            outputs = forward(module, *args, **kwargs)
        finally:
            _nested.depth -= 1
            for states, name, state in slots:
                states[name] = state
        return self._inner_outputs(outputs)

    @functools.cached_property
    def _inner_inputs(self) -> dict[str | None, Any]:
        """Each declared input's conversion in an inner region (validated once, on first use)."""
        return {
            name: input_conversion(self.mesh, src, dst, grad, f"{self.owner}: input {name!r}")
            for name, (src, dst, grad) in self._input_io.items()
        }

    @functools.cached_property
    def _inner_every_output(self) -> tuple[bool, Any]:
        """``(True, conversion)`` when one layout covers every output, else ``(False, None)``."""
        src, dst = self.out_src, self.out_dst
        if (src is None or type(src) is EveryOutput) and (dst is None or type(dst) is EveryOutput):
            src_p = src.placements if src is not None else None
            dst_p = dst.placements if dst is not None else None
            where = f"{self.owner}: output"
            return True, output_conversion(self.mesh, src_p, dst_p, where)
        return False, None

    def _inner_outputs(self, outputs: Any) -> Any:
        if self.out_src is None and self.out_dst is None:
            return outputs
        every, conversion = self._inner_every_output
        if every and type(outputs) is torch.Tensor:
            return outputs if conversion is None else convert(outputs, conversion, (self, "output"))

        def leaf(value: torch.Tensor, src: Placements | None, dst: Placements | None) -> Any:
            if isinstance(value, DTensor):
                raise TypeError(
                    f"{self.owner}: forward returned a DTensor inside an outer local_map "
                    "region, where its outputs are plain local tensors"
                )
            found = output_conversion(self.mesh, src, dst, f"{self.owner}: output")
            return value if found is None else convert(value, found, (self, "output"))

        return self._finish(outputs, self.out_src, self.out_dst, "output", leaf)

    def _refuse_dtensor_input(self, name: str) -> None:
        raise TypeError(
            f"{self.owner}: input {name!r} is a DTensor, but this local_map region is called "
            "inside another local_map region's forward, where values are plain local "
            "tensors; pass its local tensor (laid out as in_src_shardings/in_dst_shardings "
            "declare) or call the region outside the outer one"
        )

    def _refuse_inside_region(self, what: str) -> None:
        raise TypeError(
            f"{self.owner}: declares {what} without local_map but is called inside a "
            "local_map region's forward, where values are plain local tensors and no "
            "DTensor is built; give it local_map=LocalMapConfig(...) (an inner region) or "
            "call it outside the outer region"
        )

    @functools.cached_property
    def _input_io(self) -> dict[str | None, tuple[Placements | None, ...]]:
        """``(in_src, in_dst, in_grad)`` per named input that declares any (derived once)."""
        named = set(self.in_src) | set(self.in_dst) | set(self.in_grad)
        return {
            name: (self.in_src.get(name), self.in_dst.get(name), self.in_grad.get(name))
            for name in named
        }

    def _finish_local(self, outputs: Any) -> Any:
        """``finish_outputs`` with every plain output that needs a gradient wrapped in one node."""
        src, dst = self.out_src, self.out_dst
        if src is None and dst is None:
            return outputs
        if (
            type(outputs) is torch.Tensor
            and outputs.requires_grad
            and (src is None or type(src) is EveryOutput)
            and (dst is None or type(dst) is EveryOutput)
        ):  # the common case, one plain tensor: no walk over the output structure
            src_p = src.placements if src is not None else None
            dst_p = dst.placements if dst is not None else None
            layout = src_p if src_p is not None else dst_p
            assert layout is not None
            return exit_local(self.mesh, [OutputStep(layout, dst_p)], (outputs,))[0]
        pending: list[tuple[OutputStep, torch.Tensor]] = []

        def leaf(value: torch.Tensor, src: Placements | None, dst: Placements | None) -> Any:
            layout = src if src is not None else dst
            if isinstance(value, DTensor) or not value.requires_grad or layout is None:
                return self._finish_tensor(value, src, dst)
            pending.append((OutputStep(layout, dst), value))
            return _Pending(len(pending) - 1)

        result = self._finish(outputs, self.out_src, self.out_dst, "output", leaf)
        if not pending:
            return result
        finished = exit_local(self.mesh, [s for s, _ in pending], [v for _, v in pending])
        return _fill(result, finished)

    # -- outputs -----------------------------------------------------------------------
    def finish_outputs(self, outputs: Any) -> Any:
        """Wrap plain outputs (``out_src``) and redistribute them (``out_dst``)."""
        if self.out_src is None and self.out_dst is None:
            return outputs
        if _nested.depth:
            self._refuse_inside_region("out_src_shardings/out_dst_shardings")
        return self._finish(outputs, self.out_src, self.out_dst, "output", self._finish_tensor)

    def _finish(
        self,
        value: Any,
        src: OutputLayout | None,
        dst: OutputLayout | None,
        path: str,
        leaf: LeafFn,
    ) -> Any:
        if isinstance(value, torch.Tensor):
            return leaf(value, self._leaf(src, path, "out_src"), self._leaf(dst, path, "out_dst"))
        if isinstance(value, (tuple, list)):
            n = len(value)
            items = [
                self._finish(
                    item,
                    self._child(src, i, n, path, "out_src"),
                    self._child(dst, i, n, path, "out_dst"),
                    f"{path}[{i}]",
                    leaf,
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
                        leaf,
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


def _input_step(io: tuple[Placements | None, ...] | None, value: torch.Tensor) -> InputStep | None:
    """How ``value`` enters the block, given its input's ``(in_src, in_dst, in_grad)``
    (``None``: a plain tensor passed as it is)."""
    src, dst, grad = io if io is not None else (None, None, None)
    if type(value) is DTensor or isinstance(value, DTensor):
        return InputStep(None, dst, grad)
    layout = src if src is not None else dst
    return None if layout is None else InputStep(layout, dst, grad)


@dataclass(frozen=True, slots=True)
class _Pending:
    """Where the ``index``-th output of the boundary node goes in the output structure."""

    index: int


def _fill(value: Any, finished: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, _Pending):
        return finished[value.index]
    if isinstance(value, (tuple, list)):
        items = [_fill(item, finished) for item in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)  # a namedtuple
        return type(value)(items)
    if isinstance(value, dict):
        return type(value)((key, _fill(item, finished)) for key, item in value.items())
    return value


def _compiled_region(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled(forward)``, run with ``_nested.compiling`` set: the inner regions it calls
    move their tensors with collectives dynamo traces."""
    run = compiled(forward)

    def call(*args: Any, **kwargs: Any) -> Any:
        before = _nested.compiling
        _nested.compiling = True
        try:
            return run(*args, **kwargs)
        finally:
            _nested.compiling = before

    return call


def _warm_inner_regions(module: torch.nn.Module) -> None:
    """Resolve the inner regions' conversions (groups, ranks) before a compiled outer
    forward traces them: dynamo does not trace hp-dtensor's mesh code."""
    if module in _warmed:
        return
    for sub in module.modules():
        plan = getattr(sub, "_hp_forward_plan", None)
        if isinstance(plan, ForwardPlan) and plan.local_map and sub is not module:
            plan._inner_inputs  # noqa: B018 (a cached property, computed here)
            plan._inner_every_output  # noqa: B018
    _warmed.add(module)


_warmed: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(forward)``, made once per forward function (inductor, no full graph).

    Example::

        >>> compiled(len) is compiled(len)
        True
    """
    found = _compiled.get(forward)
    if found is None:
        found = _compiled[forward] = torch.compile(forward)
    return found


def compile_local_maps(model: torch.nn.Module, enabled: bool = True) -> int:
    """Run every ``local_map`` block of a parallelized ``model`` compiled (or eager again).

    The model-wide form of ``LocalMapConfig(compile=True)``: what runs on local tensors
    inside each block goes through ``torch.compile`` (inductor); the DTensor boundaries,
    and so the collectives, stay eager. Returns how many blocks it switched.

    Example::

        >>> compile_local_maps(torch.nn.Linear(2, 2))   # no local_map block: nothing to do
        0
    """
    switched = 0
    for module in model.modules():
        plan = getattr(module, "_hp_forward_plan", None)
        if isinstance(plan, ForwardPlan) and plan.local_map:
            object.__setattr__(
                module, "_hp_forward_plan", dataclasses.replace(plan, compile=enabled)
            )
            switched += 1
    return switched

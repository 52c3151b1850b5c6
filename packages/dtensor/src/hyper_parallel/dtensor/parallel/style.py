"""Parallel styles: how one module's parameters are sharded and its inputs/outputs laid out.

Names, arguments and behaviour are ``torch.distributed.tensor.parallel``'s; the
tensors are hp DTensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.dtensor._distribute import distribute_tensor
from hyper_parallel.dtensor._distribute_module import distribute_module
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.parallel._local_linear import local_linear_applies, use_local_linear
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]

Layouts = tuple[Placement | None, ...]


class ParallelStyle(ABC):
    """How :func:`parallelize_module` parallelizes one module (subclass it for a custom style).

    ``src_data_rank`` is the rank whose values ``distribute_tensor`` scatters
    (``parallelize_module`` sets it); ``None``: each rank slices its own copy.

    Example::

        class Replicated(ParallelStyle):
            def _apply(self, module, device_mesh):
                return distribute_module(module, device_mesh)
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:  # noqa: B027
        """Raise if this style cannot be applied to ``module`` (called before any change).

        Optional for a custom style: the default accepts every module.
        """


def _check_1d(style: ParallelStyle, mesh: DeviceMesh, where: str) -> None:
    if mesh.ndim != 1:
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        raise ValueError(
            f"{type(style).__name__} on {where}: expected a 1-D DeviceMesh, found a "
            f"{mesh.ndim}-D mesh{names}; pass a slice of it, e.g. mesh['tp']"
        )


def _check_fresh(module: nn.Module, where: str) -> None:
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError(
            f"{where} ({type(module).__name__}) is already parallelized; a module takes one "
            "parameter-sharding style"
        )


def _check_linear_or_embedding(style: ParallelStyle, module: nn.Module, where: str) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise NotImplementedError(
            f"{type(style).__name__} supports nn.Linear and nn.Embedding; {where} is a "
            f"{type(module).__name__}"
        )


def _shard_parameters(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int | None
) -> None:
    """Replace the module's own parameters by DTensor parameters laid out as ``placements``."""
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, placements.get("*", Replicate()))
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad,
            ),
        )


def _to_dtensor_input(
    inputs: tuple[Any, ...],
    mesh: DeviceMesh,
    input_layouts: Layouts,
    desired: Layouts,
    keep_plain: bool = False,
) -> Any:
    """The first input as a DTensor laid out as ``desired`` (a plain tensor is ``input_layouts``).

    ``keep_plain``: a plain tensor already laid out as ``desired`` stays plain (a
    local-shard linear takes it as its shard).
    """
    x = inputs[0]
    if keep_plain and input_layouts == desired and not isinstance(x, DTensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, input_layouts, run_check=False)  # type: ignore[arg-type]
    if input_layouts != desired:
        x = x.redistribute(placements=desired, async_op=True)  # type: ignore[arg-type]
    return x


def check_plain_shard_input(
    x: torch.Tensor,
    features: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    where: str,
    fix: str,
) -> None:
    """Refuse a plain ``x`` that is not this rank's shard of ``features`` input features.

    A linear whose declared input layout shards the last dim takes a plain tensor as
    this rank's slice of the features (``torch.chunk``'s sizes); the full input would
    otherwise fail deep inside the matmul (or a fallback, or the backward). The error
    names ``where``, the input's shape, the layout and ``fix``.

    Example::

        check_plain_shard_input(x, 8, mesh, [Shard(-1)], where="Linear 'wo'", fix="pass a DTensor")
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None or x.ndim == 0:
        return
    last = x.ndim - 1
    axes = [
        axis
        for axis, p in enumerate(placements)
        if isinstance(p, Shard) and p.dim in (-1, last) and mesh.size(axis) > 1
    ]
    expected = features
    for axis in axes:  # nested shards: each axis splits the previous axis's chunk
        chunk = -(-expected // mesh.size(axis))
        expected = max(0, min(chunk, expected - coordinate[axis] * chunk))
    if not axes or x.shape[-1] == expected:
        return
    names = mesh.mesh_dim_names
    ranks = 1
    for axis in axes:
        ranks *= mesh.size(axis)
    if names and len(axes) == 1:
        on = f"mesh axis {names[axes[0]]!r}"
    elif names:
        on = "mesh axes " + ", ".join(repr(names[axis]) for axis in axes)
    else:
        on = "the mesh"
    dim = next(p.dim for p in placements if isinstance(p, Shard) and p.dim in (-1, last))
    full = " (the full input)" if x.shape[-1] == features else ""
    raise RuntimeError(
        f"{where}: got a plain input of shape {tuple(x.shape)}{full}, but the declared input "
        f"layout is Shard({dim}) on {on} ({ranks} ranks), so a plain tensor is taken as this "
        f"rank's shard of the {features} input features: expected last dim {expected}; {fix}"
    )


def _check_rowwise_plain_input(module: nn.Module, x: Any, mesh: DeviceMesh) -> None:
    """RowwiseParallel's :func:`check_plain_shard_input` (a plain input must be this rank's shard)."""
    if not (isinstance(module, nn.Linear) and isinstance(x, torch.Tensor)):
        return
    ranks = mesh.size()
    check_plain_shard_input(
        x,
        module.in_features,
        mesh,
        (Shard(-1),),
        where=f"RowwiseParallel {module}",
        fix=f"pass this rank's shard (x.chunk({ranks}, dim=-1)[rank]), a DTensor, or declare "
        "RowwiseParallel(input_layouts=Replicate()) to pass the full input",
    )


def _from_dtensor_output(output: Any, output_layouts: Layouts, use_local_output: bool) -> Any:
    if not isinstance(output, DTensor):  # a local-shard linear returned its local output
        return output
    if output.placements != output_layouts:
        output = output.redistribute(placements=output_layouts, async_op=True)  # type: ignore[arg-type]
    return output.to_local() if use_local_output else output


class _LinearStyle(ParallelStyle):
    """What ColwiseParallel and RowwiseParallel share: arguments, checks, and distribution."""

    _default_input: Placement
    _default_output: Placement
    desired_input_layouts: Layouts

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts: Layouts = (input_layouts or self._default_input,)
        self.output_layouts: Layouts = (output_layouts or self._default_output,)
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:
        _check_1d(self, device_mesh, where)
        _check_linear_or_embedding(self, module, where)
        _check_fresh(module, where)

    def _distribute(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        placements: dict[str, Placement],
        kind: str,
        keep_plain_input: bool,
        check_plain_input: Callable[[nn.Module, Any, DeviceMesh], None] | None = None,
    ) -> nn.Module:
        """Shard the parameters as ``placements``; lay inputs and outputs out as declared."""
        src = self.src_data_rank
        layouts, desired = self.input_layouts, self.desired_input_layouts
        outputs, use_local = self.output_layouts, self.use_local_output

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                _shard_parameters(mod, mesh, placements, src)

        def prepare_input(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            if check_plain_input is not None and inputs and not isinstance(inputs[0], DTensor):
                check_plain_input(mod, inputs[0], mesh)
            return _to_dtensor_input(inputs, mesh, layouts, desired, keep_plain_input)

        distribute_module(
            module,
            device_mesh,
            partition,
            prepare_input,
            lambda mod, output, mesh: _from_dtensor_output(output, outputs, use_local),
        )
        use_local_linear(module, kind, outputs, use_local)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})"
        )


class ColwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by output features (an ``nn.Embedding`` by embedding dim).

    Input: a plain tensor is taken as ``input_layouts`` (default ``Replicate()``) and
    redistributed to ``Replicate()``; output: laid out as ``output_layouts`` (default
    ``Shard(-1)``), then a plain local tensor when ``use_local_output``. Weight and
    bias are ``Shard(0)`` (``Shard(1)`` for an embedding's weight).

    Example::

        parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    """

    _default_input = Replicate()
    _default_output = Shard(-1)
    desired_input_layouts: Layouts = (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear_or_embedding(self, module, type(module).__name__)
        weight_dim = 1 if isinstance(module, nn.Embedding) else 0
        # a plain replicated input stays plain: the local linear reduces its gradient itself
        keep_plain = local_linear_applies(module, "colwise", self.output_layouts)
        return self._distribute(
            module, device_mesh, {"*": Shard(weight_dim)}, "colwise", keep_plain
        )


class RowwiseParallel(_LinearStyle):
    """Shard an ``nn.Linear`` by input features (an ``nn.Embedding`` by rows, the vocabulary).

    Input: a plain tensor is taken as ``input_layouts`` (default ``Shard(-1)``) and
    redistributed to ``Shard(-1)`` (``Replicate()`` for an embedding's indices);
    output: the partial sums laid out as ``output_layouts`` (default ``Replicate()``:
    one all-reduce; ``Shard(1)``: a reduce-scatter for sequence parallel), then a
    plain local tensor when ``use_local_output``. A linear's weight is ``Shard(1)``
    and its bias ``Replicate()``; an embedding's weight ``Shard(0)``.

    Example::

        parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    """

    _default_input = Shard(-1)
    _default_output = Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_linear_or_embedding(self, module, type(module).__name__)
        placements: dict[str, Placement]
        if isinstance(module, nn.Embedding):
            placements = {"*": Shard(0)}
            self.desired_input_layouts = (Replicate(),)
        else:
            placements = {"weight": Shard(1), "bias": Replicate()}
            self.desired_input_layouts = (Shard(-1),)
        keep_plain = local_linear_applies(module, "rowwise", self.output_layouts)
        # a plain tensor is taken as input_layouts: check it fits when that is this rank's shard
        check = _check_rowwise_plain_input if self.input_layouts == (Shard(-1),) else None
        return self._distribute(module, device_mesh, placements, "rowwise", keep_plain, check)


class SequenceParallel(ParallelStyle):
    """Run a module (LayerNorm, RMSNorm, Dropout...) on activations sharded along the sequence.

    Parameters become ``Replicate()`` DTensors (no communication: each rank keeps its
    values); the input is laid out as ``Shard(sequence_dim)`` (a plain tensor is taken
    as that shard), and so is the output (a plain local tensor when
    ``use_local_output``). A replicated weight's gradient, partial across the sequence
    shards, is all-reduced in the backward (see the README: torch leaves it Partial).

    Example::

        parallelize_module(model, mesh, {"norm": SequenceParallel()})
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding: Layouts = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:
        _check_1d(self, device_mesh, where)
        _check_fresh(module, where)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharding, use_local = self.sequence_sharding, self.use_local_output

        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for p_name, param in list(mod.named_parameters(recurse=False)):
                replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
                mod.register_parameter(p_name, nn.Parameter(replicated, param.requires_grad))

        def prepare_input(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            x = inputs[0]
            if isinstance(x, DTensor):
                if x.placements != sharding:
                    x = x.redistribute(placements=sharding, async_op=True)  # type: ignore[arg-type]
                return x
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, mesh, sharding, run_check=False)  # type: ignore[arg-type]
            raise ValueError(
                f"SequenceParallel: the input of {type(mod).__name__} must be a torch.Tensor "
                f"or DTensor, found {type(x).__name__}"
            )

        return distribute_module(
            module,
            device_mesh,
            replicate,
            prepare_input,
            lambda mod, output, mesh: output.to_local() if use_local else output,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sequence_dim={self.sequence_sharding[0].dim}, "  # type: ignore[union-attr]
            f"use_local_output={self.use_local_output})"
        )


def _as_layouts(value: Placement | Sequence[Placement | None] | None) -> Layouts | None:
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    return tuple(value)


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs at run time (no parameter changes).

    Each positional input with a layout in ``input_layouts`` becomes a DTensor of that
    layout (a plain tensor is taken as its shard), then is redistributed to the
    matching entry of ``desired_input_layouts``; ``None`` leaves an input as it is.
    Keyword inputs alike with ``input_kwarg_layouts`` / ``desired_input_kwarg_layouts``.
    ``use_local_output=True`` passes local tensors on.

    Example::

        PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_layouts(input_layouts)
        self.desired_input_layouts = _as_layouts(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError(
                    "PrepareModuleInput: input_layouts is given, so desired_input_layouts is "
                    "required (one entry per input)"
                )
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(
                    f"PrepareModuleInput: input_layouts has {len(self.input_layouts)} entries, "
                    f"desired_input_layouts {len(self.desired_input_layouts)}; expected the same"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
            self.desired_input_kwarg_layouts
        ):
            raise ValueError(
                f"PrepareModuleInput: input_kwarg_layouts has {len(self.input_kwarg_layouts)} "
                f"entries, desired_input_kwarg_layouts {len(self.desired_input_kwarg_layouts)}; "
                "expected the same"
            )

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:
        _check_1d(self, device_mesh, where)

    def _prepare_input_arg(
        self,
        value: Any,
        mesh: DeviceMesh,
        layout: Placement | None,
        desired: Placement | None,
        where: str,
    ) -> Any:
        if layout is None:
            return value
        if isinstance(value, DTensor):
            dt = value
        elif isinstance(value, torch.Tensor):
            dt = DTensor.from_local(value, mesh, (layout,), run_check=False)
        else:
            raise TypeError(
                f"PrepareModuleInput: {where} has layout {layout!r}, so a torch.Tensor is "
                f"expected; found {type(value).__name__}"
            )
        if desired is not None and layout != desired:
            dt = dt.redistribute(placements=(desired,))
        return dt.to_local() if self.use_local_output else dt

    def _prepare_inputs(self, inputs: Any, mesh: DeviceMesh) -> Any:
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"PrepareModuleInput: the module got {len(inputs)} positional input(s), "
                f"input_layouts has {len(self.input_layouts)}; expected the same"
            )
        assert self.desired_input_layouts is not None  # checked in __init__
        return tuple(
            self._prepare_input_arg(value, mesh, layout, desired, f"input {i}")
            for i, (value, layout, desired) in enumerate(
                zip(inputs, self.input_layouts, self.desired_input_layouts, strict=True)
            )
        )

    def _prepare_kwargs(
        self, inputs: Any, kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> tuple[Any, dict[str, Any]]:
        prepared = {
            key: self._prepare_input_arg(
                value,
                mesh,
                self.input_kwarg_layouts.get(key),
                self.desired_input_kwarg_layouts.get(key),
                f"keyword input {key!r}",
            )
            for key, value in kwargs.items()
        }
        return self._prepare_inputs(inputs, mesh), prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda _, inputs, kwargs: self._prepare_kwargs(inputs, kwargs, device_mesh),
                with_kwargs=True,
            )
        else:
            module.register_forward_pre_hook(
                lambda _, inputs: self._prepare_inputs(inputs, device_mesh)
            )
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, "
            f"input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs at run time (no parameter changes).

    Each output with a layout in ``output_layouts`` becomes a DTensor of that layout
    (a plain tensor is taken as its shard) and is redistributed to the matching entry
    of ``desired_output_layouts``; ``None`` leaves an output as it is. Plain local
    tensors are returned when ``use_local_output`` (the default).

    Example::

        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts: Layouts = _as_layouts(output_layouts) or ()
        self.desired_output_layouts: Layouts = _as_layouts(desired_output_layouts) or ()
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: output_layouts has {len(self.output_layouts)} entries, "
                f"desired_output_layouts {len(self.desired_output_layouts)}; expected the same"
            )

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:
        _check_1d(self, device_mesh, where)

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        if len(outputs) != len(self.output_layouts):
            raise ValueError(
                f"PrepareModuleOutput: the module returned {len(outputs)} output(s), "
                f"output_layouts has {len(self.output_layouts)}; expected the same"
            )
        prepared: list[Any] = []
        for out, layout, desired in zip(
            outputs, self.output_layouts, self.desired_output_layouts, strict=True
        ):
            if layout is None:
                prepared.append(out)
                continue
            dt = out if isinstance(out, DTensor) else DTensor.from_local(out, mesh, (layout,))
            if layout != desired:
                dt = dt.redistribute(placements=(desired,))  # type: ignore[arg-type]
            prepared.append(dt.to_local() if self.use_local_output else dt)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(
            lambda _, inputs, outputs: self._prepare_outputs(outputs, device_mesh)
        )
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    ``use_local_input`` is the input side's ``use_local_output``.

    Example::

        PrepareModuleInputOutput(
            input_layouts=Shard(0), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Shard(0),
        )
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement],
        use_local_output: bool = True,
    ) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:
        _check_1d(self, device_mesh, where)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        i, o = self.prepare_module_input, self.prepare_module_output
        return (
            f"{type(self).__name__}(input_layouts={i.input_layouts}, "
            f"desired_input_layouts={i.desired_input_layouts}, "
            f"input_kwarg_layouts={i.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={i.desired_input_kwarg_layouts}, "
            f"use_local_input={i.use_local_output}, output_layouts={o.output_layouts}, "
            f"desired_output_layouts={o.desired_output_layouts}, "
            f"use_local_output={o.use_local_output})"
        )

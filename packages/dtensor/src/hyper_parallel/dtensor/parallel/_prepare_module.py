"""Styles that lay out a module's inputs and outputs at run time: ``PrepareModule*``.

They change no parameter; torch's ``PrepareModuleInput``, ``PrepareModuleOutput`` and
``PrepareModuleInputOutput``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.parallel._parallel_style import Layouts, ParallelStyle, _check_1d
from hyper_parallel.dtensor.placement_types import Placement

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]


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

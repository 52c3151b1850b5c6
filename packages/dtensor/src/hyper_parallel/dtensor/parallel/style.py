"""Parallel styles: how one module's parameters are sharded and its inputs/outputs laid out.

Names, arguments and behaviour are ``torch.distributed.tensor.parallel``'s; the
tensors are hp DTensors. The styles that shard parameters (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``) live here; the base ``ParallelStyle`` in
``_parallel_style`` and the run-time layout styles (``PrepareModule*``) in
``_prepare_module``, re-exported from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.dtensor._distribute import distribute_tensor
from hyper_parallel.dtensor._distribute_module import distribute_module
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.parallel._local_linear import local_linear_applies, use_local_linear
from hyper_parallel.dtensor.parallel._parallel_style import Layouts, ParallelStyle, _check_1d
from hyper_parallel.dtensor.parallel._prepare_module import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
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

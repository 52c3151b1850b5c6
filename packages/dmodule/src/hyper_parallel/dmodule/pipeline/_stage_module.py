"""A stage as torch's ``PipelineStage`` runs it: plain tensors at its boundary, DTensors inside."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline.split import StagePlan
from hyper_parallel.dmodule.sharding import resolve_placements
from hyper_parallel.dmodule.types import NamedPlacement, axis_name
from hyper_parallel.dtensor import DeviceMesh, DTensor, Placement, Shard
from hyper_parallel.dtensor.fsdp import FSDPModule

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Layout:
    """An activation's DTensor layout, to rebuild it from the plain tensor torch sends."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]


_OutputSpec = tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]]


class _StageModule(torch.nn.Module):
    """What torch's ``PipelineStage`` runs: one part, with plain tensors in and out.

    torch sends plain tensors (it knows torch's DTensor, not hp's): a received
    activation is rebuilt as a DTensor of the declared layout, and a DTensor output
    goes out as its local shard (the last stage's is rebuilt for the loss). The part
    is held as ``part``; its own FQNs (``Pipeline.model_parts``) are unchanged.
    """

    def __init__(self, part: torch.nn.Module, plan: StagePlan, layout: _Layout | None) -> None:
        super().__init__()
        self.part = part
        self.plan = plan
        self.layout = layout
        #: The last stage's output layout, global shape and stride, seen by its forward.
        self.output_spec: _OutputSpec | None = None

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        if not self.plan.is_first and self.layout is not None:
            args = tuple(
                DTensor.from_local(a, self.layout.mesh, self.layout.placements) for a in args
            )
        return _map_tensors(self.part(*args, **kwargs), self._send)

    def _send(self, out: torch.Tensor) -> torch.Tensor:
        if not isinstance(out, DTensor):
            return out
        placements = tuple(out.placements)
        if self.plan.is_last:
            self.output_spec = (out.device_mesh, placements, out.shape, out.stride())
            return out.to_local()
        where = f"pipeline: stage {self.plan.index}"
        layout = self.layout
        if layout is None or placements != layout.placements or out.device_mesh != layout.mesh:
            declared = None if layout is None else list(layout.placements)
            raise ValueError(
                f"{where} outputs a DTensor laid out as {list(placements)} on mesh axes "
                f"{out.device_mesh.mesh_dim_names}; the model's PipelineSplit.activation declares "
                f"{declared}, so the next stage would rebuild it wrongly"
            )
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard) and out.shape[placement.dim] % out.device_mesh.size(
                axis
            ):
                raise ValueError(
                    f"{where} outputs a DTensor of shape {tuple(out.shape)} sharded unevenly "
                    f"({placement} over {out.device_mesh.size(axis)} ranks); expected dims that "
                    f"divide evenly between stages"
                )
        return out.to_local()

    def loss(
        self, loss_fn: LossFn, output: Any, target: torch.Tensor, inputs: Mapping[str, Any]
    ) -> torch.Tensor:
        """The microbatch's loss from the last stage's output, rebuilt as the DTensor the part returned.

        A part with an ``output_loss(output, target, *, loss_fn, **inputs)`` method (a model
        whose output is this rank's share of the sequence, under context parallelism)
        computes it, with the microbatch's keyword inputs; otherwise ``loss_fn(output, target)``.
        """
        spec = self.output_spec
        if spec is not None and isinstance(output, torch.Tensor):
            mesh, placements, shape, stride = spec
            output = DTensor.from_local(output, mesh, placements, shape=shape, stride=stride)
        output_loss = getattr(self.part, "output_loss", None)
        if callable(output_loss):
            loss = output_loss(output, target, loss_fn=loss_fn, **inputs)
        else:
            loss = loss_fn(output, target)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


@functools.cache
def _stage_class() -> type[PipelineStage]:
    """torch's ``PipelineStage``, deferring hp ``fully_shard``'s gradient sync to the last backward.

    torch defers it only for its own ``FSDPModule``; a part sharded by hp's would
    reduce-scatter after every microbatch's backward. Here every backward but the one
    the schedule marks last accumulates unreduced gradients
    (``set_requires_gradient_sync(False)``), and the last reduces their sum once per
    FSDP group: the same gradients, one reduce-scatter per group per step.
    """
    from torch.distributed.pipelining import PipelineStage

    class _HpStage(PipelineStage):
        def backward_maybe_with_nosync(
            self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
        ) -> Any:
            # the input half of a split backward computes no parameter gradient
            sync = last_backward and backward_type != "input"
            for module in self.submod.modules():
                if isinstance(module, FSDPModule):
                    module.set_requires_gradient_sync(sync, recurse=False)
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    return _HpStage


def _holds_dtensors_on(part: torch.nn.Module, view: DeviceMesh) -> bool:
    """Whether a parallelized stage holds parameters that are DTensors over ``view``'s axes.

    Such a stage's blocks compute on DTensors of that view, sizes of 1 included, and so
    send and receive their activations as DTensors; a stage whose parameters are plain
    (or sharded over other axes only, as FSDP's over ``dp_shard``) sends plain tensors.
    """
    axes = set(view.mesh_dim_names or ())
    return any(
        isinstance(p, DTensor) and axes <= set(p.device_mesh.mesh_dim_names or ())
        for p in part.parameters()
    )


def _activation_layout(
    declared: NamedPlacement | None,
    mesh: DeviceMesh,
    others: tuple[str, ...],
    dims: ParallelDims | None = None,
    *,
    where: str,
) -> _Layout | None:
    """The declared layout over the mesh axes it names that this mesh has (none: plain tensors).

    With the :class:`ParallelDims` the stages are parallelized over, it lives on the view
    holding the axes it names, sizes of 1 included (for stages whose DTensors live there,
    e.g. on a ``tp`` of size 1: :func:`_holds_dtensors_on`).
    """
    if declared is None:
        return None
    if not isinstance(declared, Mapping):
        raise TypeError(
            f"{where}: PipelineSplit.activation: expected placements by mesh axis name "
            f"(e.g. {{'tp': Replicate()}}), found {declared!r}"
        )
    if dims is not None and declared:
        view = dims.view_for(declared)
        names = tuple(view.mesh_dim_names or ())
        placements = resolve_placements(declared, names, where=f"{where}: PipelineSplit.activation")
        return _Layout(view, tuple(placements))
    named = {axis_name(k) for k in declared}
    axes = tuple(a for a in others if a in named)
    if not axes:
        return None
    kept = {k: v for k, v in declared.items() if axis_name(k) in axes}
    placements = resolve_placements(kept, axes, where=f"{where}: PipelineSplit.activation")
    return _Layout(mesh[axes], tuple(placements))

"""``pipeline()``: this rank's stages of a declarative model, run by ``torch.distributed.pipelining``.

hp builds, parallelizes and initialises each stage; torch's ``PipelineStage`` and
schedules (GPipe, 1F1B, interleaved, zero bubble, DualPipeV) move the microbatches.
The schedule names and stage placement live in ``_schedules``, the stage module torch
runs (plain tensors at the boundary) in ``_stage_module``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.dmodule.model_spec import spec_for_config
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline._schedules import (
    _SINGLE_STAGE,
    _V_SHAPED,
    SCHEDULES,
    _check_microbatches,
    _schedule_name,
    stage_owner,
)
from hyper_parallel.dmodule.pipeline._stage_module import (
    LossFn,
    _activation_layout,
    _holds_dtensors_on,
    _stage_class,
    _StageModule,
)
from hyper_parallel.dmodule.pipeline.split import (
    PipelineSplit,
    StagePlan,
    build_stage,
    plan_stages,
)
from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh, collectives
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["SCHEDULES", "Pipeline", "microbatch_weights", "pipeline", "stage_owner"]

PP = axis_name(MeshAxisName.PP)


@dataclass
class _StepBatch:
    """One step's microbatches as the last stage's loss reads them, by microbatch index.

    torch's schedule hands the loss function a target per microbatch; the pipeline gives
    it the microbatch's index, so that the loss also sees the microbatch's keyword inputs
    and its weight.
    """

    targets: list[torch.Tensor] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    weights: list[float] | None = None


def microbatch_weights(
    targets: Sequence[torch.Tensor], ignore_index: int = -100
) -> list[float] | None:
    """Each microbatch's loss weight for the step's loss to be the whole batch's token mean.

    Microbatch ``i`` with ``c_i`` of the batch's ``C`` counted targets (``!= ignore_index``)
    gets ``n * c_i / C``: the mean of the weighted microbatch means is then the mean over
    all counted targets, as one process computes it on the whole batch. ``None`` (every
    weight 1) when the counts are equal, nothing is counted, or the targets are not
    integer class indices.

    Example::

        >>> t = torch.tensor([[1, -100], [2, 3]])
        >>> microbatch_weights(list(t.tensor_split(2)))
        [0.6666666666666666, 1.3333333333333333]
    """
    if not targets or any(t.is_floating_point() or t.is_complex() for t in targets):
        return None
    counts = [int((t != ignore_index).sum()) for t in targets]
    total = sum(counts)
    if total == 0 or len(set(counts)) == 1:
        return None
    return [len(counts) * c / total for c in counts]


class Pipeline:
    """This rank's pipeline stages of a model and the torch schedule that runs them.

    Made by :func:`pipeline`. ``model_parts`` are this rank's stage modules (original
    FQNs, parallelized over the mesh's other axes, on the meta device until
    :meth:`init_weights`); give their parameters to the optimizer and their state dicts
    to DCP. ``schedule`` is torch's schedule object, ``stages`` its ``PipelineStage``\\ s.

    Example::

        pipe = pipeline(model, mesh, schedule="1F1B", n_microbatches=4, loss_fn=cross_entropy)
        torch.manual_seed(0); pipe.init_weights()
        optimizer = torch.optim.AdamW([p for m in pipe.model_parts for p in m.parameters()])
        loss = pipe.step(tokens, target=targets)   # None on ranks without the last stage
        optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        *,
        mesh: DeviceMesh,
        schedule_name: str,
        n_microbatches: int,
        plans: list[StagePlan],
        local: list[int],
        modules: list[_StageModule],
        stages: list[PipelineStage],
        schedule: _PipelineSchedule,
        device: torch.device,
        batch: _StepBatch,
    ) -> None:
        self.mesh = mesh
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self.plans = plans
        #: The stage indices this rank holds, in the order of ``model_parts``.
        self.stage_indices = local
        self._modules = modules
        self.stages = stages
        self.schedule = schedule
        self.device = device
        self._batch = batch

    @property
    def model_parts(self) -> list[torch.nn.Module]:
        """This rank's stage modules, first stage first (each keeps the full model's FQNs)."""
        return [m.part for m in self._modules]

    @property
    def num_stages(self) -> int:
        """Stages in the whole pipeline (``pp * stages_per_rank``)."""
        return len(self.plans)

    @property
    def has_first_stage(self) -> bool:
        """True when this rank holds stage 0 (it takes the inputs)."""
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        """True when this rank holds the last stage (it takes the targets, returns the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def init_weights(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Allocate this rank's parts and initialise them as one device would after the same seed.

        Stage by stage in pipeline order: the rank holding a stage fills it
        (``init_weights`` of the part: only this rank's shards, with their slices of the
        full draws), then hands its random generators' states to the whole ``pp`` group.
        A rank thus never draws (nor allocates) another stage's values, yet every stage
        starts from the state one device reaches there; afterwards every rank's
        generators are where one device's are after ``model.init_weights()``. A
        collective over ``pp``: every rank calls it.

        Example::

            torch.manual_seed(0)
            pipe.init_weights()
        """
        for module in self._modules:
            if any(t.is_meta for t in (*module.part.parameters(), *module.part.buffers())):
                module.part.to_empty(device=self.device)
        pp = self.mesh.size(PP)
        me = self.mesh.get_local_rank(PP)
        for index in range(self.num_stages):
            owner = stage_owner(index, pp, self.schedule_name)
            if owner == me:
                part = self._modules[self.stage_indices.index(index)].part
                part.init_weights(buffer_device=buffer_device)  # type: ignore[operator]
            if pp > 1:
                self._relay_generators(owner)

    def _relay_generators(self, src: int) -> None:
        """Set every ``pp`` rank's generators to those of ``pp`` rank ``src`` (a broadcast)."""
        cpu_state = torch.get_rng_state()
        states = [cpu_state]
        device_module = None
        if self.device.type != "cpu":
            device_module = torch.get_device_module(self.device)
            states.append(device_module.get_rng_state(self.device))
        sizes = [s.numel() for s in states]
        packed = torch.cat(states).to(self.device)
        got = collectives.broadcast(packed, self.mesh, PP, src).cpu()
        parts = torch.split(got, sizes)
        torch.set_rng_state(parts[0].clone())
        if device_module is not None:
            device_module.set_rng_state(parts[1].clone(), self.device)

    def step(
        self,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None = None,
        **forward_inputs: torch.Tensor,
    ) -> torch.Tensor | None:
        """One training step's forward and backward over ``n_microbatches`` microbatches.

        ``inputs`` (used on the rank holding the first stage) and ``target`` (on the rank
        holding the last) are the whole batch, split along dim 0. ``forward_inputs`` are
        keyword inputs of the model's forward (e.g. ``document_ids``): the whole batch on
        *every* rank, split the same way and given to every stage (and to the last
        stage's ``output_loss``). Returns the loss where this rank holds the last stage,
        ``None`` elsewhere: the mean over the whole batch's counted targets (each
        microbatch's mean weighted by its share of the targets that are not -100, see
        :func:`microbatch_weights`), as one process computes it. Gradients accumulate
        into the parts' ``.grad`` and equal the full batch's (torch's schedules divide
        them by ``n_microbatches``: ``loss_fn`` must average, as a mean cross-entropy
        does). Every rank of the pipeline calls it. A part with a ``check_batch(inputs,
        target, **forward_inputs)`` method first checks what its rank holds of the batch
        (``None`` for what it does not), so that a bad batch is refused before the
        schedule exchanges anything.

        Example::

            loss = pipe.step(tokens, target=targets)
            loss = pipe.step(tokens, target=targets, document_ids=document_ids)  # packed
        """
        return self._run(inputs, target, forward_inputs, backward=True)

    def eval(
        self,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None = None,
        **forward_inputs: torch.Tensor,
    ) -> torch.Tensor | None:
        """:meth:`step`'s forward only (torch's ``schedule.eval``): the same batch contract,
        checks and loss, no backward and no gradients.

        Example::

            with torch.no_grad():
                val_loss = pipe.eval(tokens, target=targets)
        """
        return self._run(inputs, target, forward_inputs, backward=False)

    def _run(
        self,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None,
        forward_inputs: dict[str, torch.Tensor],
        *,
        backward: bool,
    ) -> torch.Tensor | None:
        for name, value in (("inputs", inputs), ("target", target), *forward_inputs.items()):
            if value is not None:
                self._check_batch(name, value)
        if self.has_first_stage and inputs is None:
            raise ValueError(
                "Pipeline.step: this rank holds the first stage and needs the inputs; found None"
            )
        if self.has_last_stage and target is None:
            raise ValueError(
                "Pipeline.step: this rank holds the last stage and needs the target to compute "
                "the loss; found None"
            )
        # every rank refuses what it can see of a bad batch before any exchange starts
        for module in self._modules:
            check = getattr(module.part, "check_batch", None)
            if callable(check):
                check(
                    inputs if module.plan.is_first else None,
                    target if module.plan.is_last else None,
                    **forward_inputs,
                )
        n = self.n_microbatches
        split = {name: value.tensor_split(n) for name, value in forward_inputs.items()}
        kwarg_mbs = [{name: chunks[i] for name, chunks in split.items()} for i in range(n)]
        arg_mbs: list[tuple[torch.Tensor, ...]] = [()] * n
        if self.has_first_stage and inputs is not None:
            arg_mbs = [(chunk,) for chunk in inputs.tensor_split(n)]
        target_mbs = None
        batch = self._batch
        if self.has_last_stage:
            assert target is not None
            batch.targets = list(target.tensor_split(n))
            batch.inputs = kwarg_mbs
            batch.weights = microbatch_weights(batch.targets)
            # the loss function gets the microbatch's index and finds the rest in batch
            target_mbs = [torch.tensor(i) for i in range(n)]
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        try:
            if backward:
                self.schedule.step(
                    arg_mbs=arg_mbs,
                    kwarg_mbs=kwarg_mbs,
                    target_mbs=target_mbs,
                    losses=losses,
                    return_outputs=False,
                )
            else:
                self.schedule.eval(
                    arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses
                )
        finally:
            batch.targets, batch.inputs, batch.weights = [], [], None
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _check_batch(self, name: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise TypeError(
                f"Pipeline.step: {name}: expected a tensor with a batch dim 0, found {value!r}"
            )
        batch = value.shape[0]
        if batch % self.n_microbatches:
            raise ValueError(
                f"Pipeline.step: {name}: a batch of {batch} does not divide into "
                f"n_microbatches={self.n_microbatches} equal microbatches; expected a batch size "
                f"that is a multiple of {self.n_microbatches}"
            )

    def __repr__(self) -> str:
        return (
            f"Pipeline(schedule={self.schedule_name!r}, stages={self.stage_indices} of "
            f"{self.num_stages}, n_microbatches={self.n_microbatches})"
        )


def pipeline(
    model: BaseModel,
    mesh: DeviceMesh | ParallelDims,
    *,
    schedule: str = "1F1B",
    n_microbatches: int,
    loss_fn: LossFn,
    stages_per_rank: int = 1,
    split: Sequence[int] | None = None,
    parallelize_options: object = None,
) -> Pipeline:
    """Cut ``model`` into stages over mesh axis ``pp``; build and parallelize this rank's.

    ``model`` is a :class:`BaseModel` (built on the meta device) whose registered
    :class:`ModelSpec` declares ``pipeline_split`` (how to cut it) and, for the mesh's
    other axes (``tp``, ``dp_shard``, ``dp_replicate``), the ``parallelize_fn`` applied to
    each stage as without pipelining. ``schedule`` is one of torch's :data:`SCHEDULES`;
    ``stages_per_rank`` > 1 needs a multi-stage one (``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``; ``ZBVZeroBubble`` and ``DualPipeV`` need 2). ``split``
    lists the layer where each stage starts (default: even, the embeddings on the first
    stage and the norm and head on the last). Every argument is checked before anything
    is built. ``loss_fn(output, target)`` gets the last stage's output as the model
    returns it (a DTensor once parallelized) and must return the mean loss. With a
    :class:`ParallelDims`, its world mesh gives ``pp`` and each stage is parallelized
    over the ``ParallelDims`` itself (a view per state). ``parallelize_options`` is the
    ``job_config`` each stage's ``parallelize_fn`` gets (e.g. ``activation_checkpoint``,
    ``mp_policy``), as the whole model's would without pipelining.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        with torch.device("meta"):
            model = Llama.Config(n_layers=4).build()
        pipe = pipeline(model, mesh, schedule="1F1B", n_microbatches=4, loss_fn=cross_entropy)
    """
    where = "pipeline"
    if not isinstance(model, BaseModel):
        raise TypeError(f"{where}: expected a BaseModel, found {type(model).__name__}")
    cls = type(getattr(type(model), "_hp_parallel_base", None) or type(model)).__name__
    config = getattr(model, "config", None)
    spec = spec_for_config(config) if config is not None else None
    cut = getattr(spec, "pipeline_split", None) if spec is not None else None
    if not isinstance(cut, PipelineSplit):
        found = "no registered ModelSpec" if spec is None else f"ModelSpec {spec.name!r}"
        raise ValueError(
            f"{where}: expected the ModelSpec of {cls} to declare how to cut it "
            f"(ModelSpec(..., pipeline_split=PipelineSplit(layers=..., first=..., last=...))); "
            f"found {found} without pipeline_split"
        )
    dims = mesh if isinstance(mesh, ParallelDims) else None
    if dims is not None:
        mesh = dims.world_mesh
    names = tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else ()
    if not isinstance(mesh, DeviceMesh) or PP not in names:
        raise ValueError(
            f"{where}: expected a DeviceMesh with a {PP!r} axis, found "
            f"{'mesh axes ' + repr(names) if isinstance(mesh, DeviceMesh) else repr(mesh)}"
        )
    schedule_name = _schedule_name(schedule, where=where)
    for arg, value in (("n_microbatches", n_microbatches), ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {arg}: expected an int >= 1, found {value!r}")
    key = schedule_name.lower()
    if key in _SINGLE_STAGE and stages_per_rank != 1:
        raise ValueError(
            f"{where}: schedule {schedule_name!r} runs one stage per rank; found "
            f"stages_per_rank={stages_per_rank} (multi-stage schedules: Interleaved1F1B, "
            f"LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"
        )
    if key in _V_SHAPED and stages_per_rank != 2:
        raise ValueError(
            f"{where}: schedule {schedule_name!r} places exactly 2 stages per rank (a V); found "
            f"stages_per_rank={stages_per_rank}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn: expected a callable (output, target) -> loss, found {loss_fn!r}"
        )
    pp = mesh.size(PP)
    num_stages = pp * stages_per_rank
    _check_microbatches(schedule_name, n_microbatches, pp, num_stages, where=where)
    plans = plan_stages(model, cut, num_stages, split, where=where)
    others = tuple(n for n in names if n != PP)
    declared = cut.activation_layout(config)
    layout = _activation_layout(declared, mesh, others, where=where)
    # stages parallelized over the dims themselves (the mesh has other axes) may hold
    # DTensors on a view with axes of size 1 (a tp of 1 under ep): their activations too
    dims_layout = (
        _activation_layout(declared, mesh, others, dims, where=where)
        if dims is not None and others
        else None
    )

    # -- build: nothing above allocated, communicated or changed the model ------------
    from torch.distributed.pipelining.schedules import get_schedule_class  # heavy: when used

    me = mesh.get_local_rank(PP)
    local = [s for s in range(num_stages) if stage_owner(s, pp, schedule_name) == me]
    stage_mesh: DeviceMesh | ParallelDims | None = mesh[others] if others else None
    if dims is not None and others:
        stage_mesh = dims
    parallelize_fn = spec.parallelize_fn if spec is not None else None
    device = get_platform().device_for(mesh.device_type)
    group = mesh.get_group(PP)
    modules: list[_StageModule] = []
    stages: list[PipelineStage] = []
    for index in local:
        part = build_stage(model, cut, plans[index])
        if stage_mesh is not None:  # the same call as for the whole model without pipelining
            if parallelize_fn is not None:
                part = parallelize_fn(part, stage_mesh, parallelize_options) or part
            else:
                part.parallelize(stage_mesh)  # type: ignore[operator]
        on_view = dims_layout is not None and _holds_dtensors_on(part, dims_layout.mesh)
        module = _StageModule(part, plans[index], dims_layout if on_view else layout)
        modules.append(module)
        stages.append(_stage_class()(module, index, num_stages, device, group=group))
    last = next((m for m in modules if m.plan.is_last), None)
    batch = _StepBatch()

    def stage_loss(output: Any, microbatch: torch.Tensor) -> torch.Tensor:
        assert last is not None  # torch computes the loss on the last stage only
        index = int(microbatch)  # what Pipeline.step passes torch as the target
        loss = last.loss(loss_fn, output, batch.targets[index], batch.inputs[index])
        return loss if batch.weights is None else loss * batch.weights[index]

    schedule_cls = get_schedule_class(schedule_name)
    runner: _PipelineSchedule
    if key in _SINGLE_STAGE:
        runner = schedule_cls(stages[0], n_microbatches, loss_fn=stage_loss, scale_grads=True)
    else:
        runner = schedule_cls(stages, n_microbatches, loss_fn=stage_loss, scale_grads=True)
    return Pipeline(
        mesh=mesh,
        schedule_name=schedule_name,
        n_microbatches=n_microbatches,
        plans=plans,
        local=local,
        modules=modules,
        stages=stages,
        schedule=runner,
        device=device,
        batch=batch,
    )

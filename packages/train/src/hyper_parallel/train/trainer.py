"""The trainer: one rank's job from a JobConfig, as its phases: plan, build, restore, loop, finish.

The checks a job passes before it runs are in :mod:`hyper_parallel.train.checks`; the
model's Config and its parallelized build in :mod:`hyper_parallel.train.build`.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.checkpoint import (
    CheckpointCorruptError,
    ModelState,
    PendingSave,
    StateDictOptions,
    TrainingState,
    load,
    save,
    step_path,
)
from hyper_parallel.dmodule.layers import MoE, moe_aux_loss, update_load_balance
from hyper_parallel.dmodule.models.training import StepResult, eval_loss, train_step
from hyper_parallel.dmodule.pipeline import Pipeline
from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives, init_device_mesh
from hyper_parallel.platform import get_platform
from hyper_parallel.train.build import (
    BuiltModel,
    build_model,
    build_model_config,
    build_optimizer,
    model_job_config,
)
from hyper_parallel.train.checkpoints import (
    check_checkpoint_dir,
    check_resume,
    checkpoint_info,
    clear_checkpoints,
    corrupt_checkpoint_error,
)
from hyper_parallel.train.checks import check_layout, parallel_dims, resolve_world
from hyper_parallel.train.config import JobConfig, batch_layout
from hyper_parallel.train.data import Batch, PackedSamples, Prefetcher
from hyper_parallel.train.export import export_hf
from hyper_parallel.train.job_data import check_resumed_data, load_job_data, make_sampler
from hyper_parallel.train.lr import lr_at
from hyper_parallel.train.metrics import MetricsLogger, RunSummary, StartupTimes, StepMetrics
from hyper_parallel.train.mixture import Mixture
from hyper_parallel.train.precision import autocast_dtype, mixed_precision_policy
from hyper_parallel.train.tokenizer import Tokenizer, build_tokenizer

# the checks', the build's and the precision's names stay importable from here, where they were
__all__ = [
    "RunSummary",
    "autocast_dtype",
    "build_model_config",
    "check_layout",
    "check_resume",
    "load_samples",
    "mixed_precision_policy",
    "model_job_config",
    "parallel_dims",
    "resolve_world",
    "train",
    "validate",
]


def train(
    job: JobConfig,
    *,
    resume: bool = False,
    allow_imports: tuple[str, ...] = (),
    log: bool = True,
    stop_file: str = "",
    startup: StartupTimes | None = None,
) -> RunSummary | None:
    """Run ``job`` on this rank (inside a process group); rank 0 returns the summary.

    SIGTERM/SIGINT during the steps, or the file ``stop_file`` appearing (how ``hp-train``'s
    launcher passes on a signal it received), ends the run after the current step, saving
    a checkpoint of that step when ``checkpoint.dir`` is set. ``startup``: the phases timed
    before this call (the launcher's ``imports``); rank 0 prints them with this run's.

    Example::

        >>> run_distributed(train, 2, args=(load_job("job.toml"),))  # doctest: +SKIP
    """
    times = startup if startup is not None else StartupTimes()
    plan = _plan(job, resume, allow_imports, times)
    built = build_model(plan.job, plan.model_config, plan.dims, plan.device, times)
    state = _restore(plan, built, resume, times)
    loop = _Loop(plan, built, state, resume=resume, log=log, times=times)
    loop.run(_Stop(stop_file))
    return loop.finish()


@dataclass
class _Plan:
    """The job resolved for this rank's world: its degrees (mesh built), tokenizer, model Config."""

    job: JobConfig
    rank: int
    world: int
    device: torch.device
    dims: ParallelDims
    tokenizer: Tokenizer
    model_config: Any
    local_batch: int
    accumulation: int


def _plan(
    job: JobConfig, resume: bool, allow_imports: tuple[str, ...], times: StartupTimes
) -> _Plan:
    """Check the job against this world and build its mesh (timed as ``mesh``)."""
    platform = get_platform()
    rank, world = platform.get_rank(), platform.get_world_size()
    job = resolve_world(job, world)
    check_layout(job, world)
    check_checkpoint_dir(job, resume=resume)
    tokenizer = build_tokenizer(job.tokenizer.path)
    model_config = build_model_config(job, tokenizer.vocab_size, allow_imports)
    local_batch, accumulation = batch_layout(job)
    dims = parallel_dims(job, world)
    with times.phase("mesh"):
        dims.build_mesh(job.training.device)
    device = platform.device_for(job.training.device)
    return _Plan(job, rank, world, device, dims, tokenizer, model_config, local_batch, accumulation)


@dataclass
class _State:
    """What the loop advances and a checkpoint holds (``app``): optimizer, data position, step, RNG."""

    optimizer: torch.optim.Optimizer
    sampler: Prefetcher
    val_samples: PackedSamples | Mixture
    train: TrainingState
    app: dict[str, Any]


def _restore(plan: _Plan, built: BuiltModel, resume: bool, times: StartupTimes) -> _State:
    """The optimizer and the data (timed as ``data``), loaded from the newest checkpoint on resume."""
    job = plan.job
    optimizer = build_optimizer(job, built.parts)
    with times.phase("data"):
        data = load_job_data(job, plan.tokenizer)
    sampler = Prefetcher(  # the next step's batches are read while a step runs
        make_sampler(
            data.train,
            seed=job.training.seed,
            dp_rank=plan.dims.batch_mesh.get_local_rank(0),
            dp=plan.dims.dp,
            local_batch=plan.local_batch,
            accumulation=plan.accumulation,
        )
    )
    state = TrainingState(device=plan.device)
    # a stage keeps the full model's FQNs: each rank saves and loads its own stage's states;
    # optimizer states keyed by FQN too (as TorchTitan), not by group index that stages share
    (held,) = built.parts  # the trainer's pipelines hold one stage per rank
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    app: dict[str, Any] = {"app": ModelState(held, optimizer, options=options), "train": state}
    if resume:
        with times.phase("checkpoint"):
            try:  # rank 0 checks the files against the manifest before anything is unpickled
                loaded = load(app, job.checkpoint.dir, step=check_resume(job))
            except CheckpointCorruptError as error:
                raise corrupt_checkpoint_error(error) from error
        saved_model = state.extra.get("model")
        if saved_model not in (None, job.model.name):
            raise ConfigError(
                f"--resume: expected a checkpoint of model {job.model.name!r}, found one of "
                f"{saved_model!r} in {str(step_path(job.checkpoint.dir, loaded))!r}",
                path="checkpoint.dir",
            )
        check_resumed_data(state.extra.get("data"), job, str(step_path(job.checkpoint.dir, loaded)))
        sampler.position = state.data_position
    elif job.checkpoint.overwrite and plan.rank == 0:
        clear_checkpoints(job)  # checked: a fresh run into another run's checkpoints
    state.extra["model"] = job.model.name
    state.extra["data"] = data.identity
    return _State(optimizer, sampler, data.validation, state, app)


class _Loop:
    """The steps of a run: train, log, validate, checkpoint; and the run's end (:meth:`finish`)."""

    def __init__(
        self,
        plan: _Plan,
        built: BuiltModel,
        state: _State,
        *,
        resume: bool,
        log: bool,
        times: StartupTimes,
    ) -> None:
        job, dims = plan.job, plan.dims
        self.plan, self.built, self.state = plan, built, state
        step = state.train.step
        self.metrics = (
            MetricsLogger(job, rank=plan.rank, resumed_after=step if resume else None)
            if log
            else None
        )
        self.summary = RunSummary(first_step=step + 1, startup_seconds=dict(times.seconds))
        # the loss is averaged where the batch is split; replicas FSDP does not cover average here
        self.loss_mesh = dims.loss_mesh
        self.loss_axes: tuple[str, ...] = ("loss",) if dims.loss_mesh.size() > 1 else ()
        self.average_over = (
            None if dims.fsdp_enabled or dims.dp == 1 else (dims.batch_mesh, "batch")
        )
        self.pp_mesh = dims.get_mesh("pp") if dims.pp_enabled else None
        # MoE: token counts are summed over the ranks that route different tokens (the loss view)
        self.balance_mesh = self.loss_mesh if self.loss_mesh.size() > 1 else None
        self.routed = bool(_moe_layers(built.parts))  # found once, not every step
        self.stepped: torch.nn.Module | Pipeline = (
            built.pipe if built.pipe is not None else built.model
        )
        if built.pipe is None and any(
            m.config.aux_loss_coeff > 0 for m in _moe_layers(built.parts)
        ):
            self.stepped = _WithAuxLoss(built.model)
        self.pending: PendingSave | None = None
        if self.metrics is not None:
            self.metrics.start(nparams=built.nparams, world=plan.world, first_step=step + 1)
            self.metrics.note(times.line())
        self.everyone = init_device_mesh(
            job.training.device, (plan.world,), mesh_dim_names=("world",)
        )

    def run(self, stop: _Stop) -> None:
        """Steps ``first_step..training.steps``, or up to the step a stop request arrives in."""
        job = self.plan.job
        profile = _profiler(job, self.plan.rank, self.summary.first_step)
        with stop.installed(), profile as profiler:
            for step in range(self.summary.first_step, job.training.steps + 1):
                self._train_step(step)
                if profiler is not None:
                    profiler.step()
                if job.validation.interval and step % job.validation.interval == 0:
                    self._validate(step)
                stopping = _agree(stop.requested, self.everyone, self.plan.device)
                self._checkpoint(step, stopping)
                if stopping:
                    self.summary.stopped_by_signal = True
                    self._note(f"stopped by a signal after step {step}; resume with --resume")
                    break

    def _train_step(self, step: int) -> None:
        job, state, summary = self.plan.job, self.state, self.summary
        start = time.perf_counter()
        microbatches = [_model_inputs(b, self.plan.device) for b in state.sampler.next_step()]
        data_seconds = time.perf_counter() - start
        lr = lr_at(step, job.optimizer.lr, job.lr_scheduler)
        for group in state.optimizer.param_groups:
            group["lr"] = lr
        result: StepResult = train_step(
            self.stepped,
            microbatches,
            state.optimizer,
            loss_mesh=self.loss_mesh,
            loss_axes=self.loss_axes,
            pp_mesh=self.pp_mesh,
            average_over=self.average_over,
            max_norm=job.training.max_norm,
            skip_nonfinite=job.training.skip_nonfinite,
            step=step,
            autocast_dtype=autocast_dtype(job),
        )
        if result.stepped and self.routed:
            for part in self.built.parts:
                update_load_balance(part, self.balance_mesh)
        seconds = time.perf_counter() - start
        state.train.step, state.train.data_position = step, state.sampler.position
        summary.losses.append(result.loss)
        summary.lrs.append(lr)
        summary.grad_norms.append(result.grad_norm)
        summary.seconds.append(seconds)
        if self.metrics is not None and (
            step % job.metrics.log_interval == 0 or step == job.training.steps
        ):
            tokens_per_step = job.training.global_batch_size * job.training.seq_len
            self.metrics.log_step(
                StepMetrics(
                    step=step,
                    loss=result.loss,
                    lr=lr,
                    grad_norm=result.grad_norm,
                    tokens_per_second=tokens_per_step / seconds,
                    tflops_per_device=self.built.flops_per_token
                    * tokens_per_step
                    / seconds
                    / self.plan.world
                    / 1e12,
                    data_wait=data_seconds / seconds,
                    epoch=state.sampler.epoch,
                    memory_gib=_peak_memory_gib(self.plan.device),
                ),
                steps=job.training.steps,
            )

    def _validate(self, step: int) -> None:
        plan, built = self.plan, self.built
        val = validate(
            built.pipe if built.pipe is not None else built.model,
            self.state.val_samples,
            plan.job,
            self.loss_mesh,
            self.loss_axes,
            plan.dims.batch_mesh.get_local_rank(0),
            plan.dims.dp,
            plan.local_batch,
            plan.device,
            pp_mesh=self.pp_mesh,
        )
        self.summary.val_losses[step] = val
        if self.metrics is not None:
            self.metrics.log_validation(step, val)

    def _checkpoint(self, step: int, stopping: bool) -> None:
        """Save ``step`` when it is due (interval, the last step, a stop request)."""
        job = self.plan.job
        due = bool(job.checkpoint.dir) and (
            step == job.training.steps
            or (job.checkpoint.interval and step % job.checkpoint.interval == 0)
            or stopping
        )
        if not due:
            return
        if self.pending is not None:
            self.pending.wait()
        saved = save(
            self.state.app,
            job.checkpoint.dir,
            step=step,
            async_save=job.checkpoint.async_save and not stopping,
            info=checkpoint_info(job),
        )
        if isinstance(saved, PendingSave):
            self.pending = saved
            self.summary.last_checkpoint = str(saved.path)
        else:
            self.pending = None
            self.summary.last_checkpoint = str(saved)
            _keep_last(job, self.plan.rank)
        self._note(f"checkpoint {self.summary.last_checkpoint}")

    def finish(self) -> RunSummary | None:
        """Commit a save in flight, export Hugging Face weights, close the metrics."""
        job, plan, built = self.plan.job, self.plan, self.built
        self.state.sampler.close()
        if self.pending is not None:
            self.pending.wait()
            _keep_last(job, plan.rank)
        if job.checkpoint.export_hf:
            export_hf(built.model, built.parts, self.pp_mesh, plan.device, job.checkpoint.export_hf)
            self._note(f"exported Hugging Face weights to {job.checkpoint.export_hf}")
        if self.metrics is not None:
            self.metrics.finish(self.summary)
        return self.summary if plan.rank == 0 else None

    def _note(self, text: str) -> None:
        if self.metrics is not None:
            self.metrics.note(text)


class _Stop:
    """SIGTERM/SIGINT, or ``stop_file`` appearing: the loop saves at the end of the step and exits."""

    def __init__(self, stop_file: str = "") -> None:
        self.signalled = False
        self.stop_file = stop_file

    @property
    def requested(self) -> bool:
        """Whether this rank was asked to stop (a stat of ``stop_file`` per step at most)."""
        return self.signalled or bool(self.stop_file and os.path.exists(self.stop_file))

    @contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.signalled = True

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def load_samples(job: JobConfig, tokenizer: Tokenizer) -> tuple[PackedSamples, PackedSamples]:
    """The training samples and the validation samples (``validation.path`` or a held-out tail)
    of a job on one source (``load_job_data`` reads ``data.mix`` too)."""
    data = load_job_data(job, tokenizer)
    if not isinstance(data.train, PackedSamples) or not isinstance(data.validation, PackedSamples):
        raise ConfigError("load_samples reads one source: use load_job_data", path="data.mix")
    return data.train, data.validation


def validate(
    model: torch.nn.Module | Pipeline,
    samples: PackedSamples | Mixture,
    job: JobConfig,
    mesh: DeviceMesh,
    dp_axes: tuple[str, ...],
    dp_rank: int,
    dp: int,
    local_batch: int,
    device: torch.device,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> float:
    """Mean loss over ``validation.steps`` global batches of the held-out samples (same every time).

    ``model`` is the trained module or its :class:`Pipeline` (forward only through the
    schedule; ``pp_mesh`` carries the last stage's loss to every stage's ranks).

    Example::

        val = validate(pipe, held_out, job, loss_mesh, ("loss",), dp_rank, dp, 4, device,
                       pp_mesh=dims.get_mesh("pp"))
    """
    sampler = make_sampler(
        samples,
        seed=0,
        dp_rank=dp_rank,
        dp=dp,
        local_batch=local_batch,
        accumulation=1,
        shuffle=False,
    )
    total = torch.zeros(1, device=device)
    for _ in range(job.validation.steps):
        microbatches = [_model_inputs(b, device) for b in sampler.next_step()]
        total += eval_loss(model, microbatches, pp_mesh=pp_mesh, autocast_dtype=autocast_dtype(job))
    # validation routes no training tokens: load balancing counts only the training batches
    parts = list(model.model_parts) if isinstance(model, Pipeline) else [model]
    for layer in _moe_layers(parts):
        if layer.tokens_per_expert is not None:
            _local(layer.tokens_per_expert).zero_()
    mean = total / job.validation.steps
    if dp_axes:
        mean = collectives.all_reduce_over(mean, mesh, dp_axes, "avg")
    return float(mean.item())


def _model_inputs(batch: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(tokens, targets[, document_ids])`` of a microbatch, on ``device``.

    ``document_ids`` only when a row packs more than one document: a row of one document
    is plain causal attention with positions from 0, the same numbers without the
    document mask's work (checked on the host, before the copy to ``device``).
    """
    packed = bool(batch.document_ids.any())
    on_device = batch.to(device)
    if packed:
        return on_device.tokens, on_device.targets, on_device.document_ids
    return on_device.tokens, on_device.targets


def _moe_layers(parts: list[torch.nn.Module]) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _WithAuxLoss(torch.nn.Module):
    """The model whose ``loss`` adds its MoE layers' auxiliary loss (``aux_loss_coeff > 0``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self._takes_documents = "document_ids" in inspect.signature(model.loss).parameters  # type: ignore[arg-type]

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        documents = {"document_ids": document_ids} if self._takes_documents else {}
        loss: torch.Tensor = self.model.loss(tokens, targets, **documents)  # type: ignore[operator]
        aux = moe_aux_loss(self.model)
        return loss if aux is None else loss + aux


def _agree(flag: bool, everyone: DeviceMesh, device: torch.device) -> bool:
    """Whether any rank's ``flag`` is set (one all-reduce over the world)."""
    if everyone.size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(collectives.all_reduce(value, everyone, 0, "max").item() > 0)


def _keep_last(job: JobConfig, rank: int) -> None:
    """Remove committed checkpoints beyond the newest ``checkpoint.keep`` (rank 0)."""
    if rank != 0 or job.checkpoint.keep <= 0:
        return
    root = Path(job.checkpoint.dir)
    steps = sorted(
        int(p.name.split("-", 1)[1]) for p in root.glob("step-*") if (p / ".metadata").is_file()
    )
    for old in steps[: -job.checkpoint.keep]:
        shutil.rmtree(step_path(root, old), ignore_errors=True)


def _peak_memory_gib(device: torch.device) -> float:
    """Accelerator max allocated, or this process's max RSS on the CPU, in GiB."""
    if device.type != "cpu":
        module = torch.get_device_module(device)
        return float(module.max_memory_allocated(device)) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _profiler(job: JobConfig, rank: int, first_step: int) -> Any:
    """A torch.profiler over steps ``start_step..end_step`` when ``profiling.dir`` is set.

    Steps count from the job's start: a run resumed at ``first_step`` profiles what is left
    of the range, and writes nothing once the range is behind it.
    """
    prof = job.profiling
    if not prof.dir or prof.start_step < 1 or prof.end_step < max(prof.start_step, first_step):
        return nullcontext(None)
    directory = Path(prof.dir)

    def export(profiler: torch.profiler.profile) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(directory / f"rank{rank}.json"))

    return torch.profiler.profile(
        schedule=torch.profiler.schedule(
            wait=max(prof.start_step - first_step, 0),
            warmup=0,
            active=prof.end_step - max(prof.start_step, first_step) + 1,
            repeat=1,
        ),
        on_trace_ready=export,
    )

"""The trainer: one rank's job (model, data, optimizer, loop, metrics, checkpoints) from a JobConfig."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims, get_spec
from hyper_parallel.dmodule.checkpoint import (
    ModelState,
    PendingSave,
    StateDictOptions,
    TrainingState,
    latest_step,
    load,
    load_hf,
    save,
    save_hf,
    step_path,
)
from hyper_parallel.dmodule.layers import MoE, moe_aux_loss, update_load_balance
from hyper_parallel.dmodule.models.training import StepResult, eval_loss, train_step
from hyper_parallel.dmodule.pipeline import Pipeline
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    FallbackWarning,
    collectives,
    init_device_mesh,
)
from hyper_parallel.dtensor.fsdp import MixedPrecisionPolicy
from hyper_parallel.platform import get_platform
from hyper_parallel.train.config import DEFAULT_ALLOWED_IMPORTS, JobConfig, batch_layout
from hyper_parallel.train.data import Batch, PackedSamples, Prefetcher
from hyper_parallel.train.job_data import check_resumed_data, load_job_data, make_sampler
from hyper_parallel.train.lr import lr_at
from hyper_parallel.train.metrics import MetricsLogger, StepMetrics
from hyper_parallel.train.mixture import Mixture
from hyper_parallel.train.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "RunSummary",
    "autocast_dtype",
    "mixed_precision_policy",
    "parallel_dims",
    "resolve_world",
    "build_model_config",
    "check_layout",
    "check_resume",
    "load_samples",
    "train",
    "validate",
]


@dataclass
class RunSummary:
    """What rank 0 returns: every step's loss and rate of this run, and the validation losses."""

    first_step: int
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    #: wall seconds of each step (data, forward, backward, update, loss reduction)
    seconds: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    stopped_by_signal: bool = False
    last_checkpoint: str = ""


def _register_models() -> None:
    """Import hp-dmodule's reference models, each of which registers its spec on import."""
    import hyper_parallel.dmodule.models as models

    for info in pkgutil.iter_modules(models.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{models.__name__}.{info.name}")


def build_model_config(
    job: JobConfig, tokenizer_vocab: int, allow_imports: tuple[str, ...] = ()
) -> Any:
    """The model's Config: the spec's flavor (or the HF directory's), then ``[model.config]``.

    Without ``vocab_size`` in ``[model.config]`` (and no HF start) the vocabulary is raised to
    the tokenizer's when it is smaller; a ``vocab_size`` given below the tokenizer's is an error.

    Example::

        >>> build_model_config(JobConfig(), 257).vocab_size
        257
    """
    _register_models()
    try:
        spec = get_spec(job.model.name)
    except LookupError as error:
        raise ConfigError(str(error).strip("'\""), path="model.name") from error
    if job.model.hf_dir:
        config_cls = type(spec.config(job.model.flavor if job.model.flavor else None))
        from_hf = getattr(config_cls, "from_hf", None)
        if from_hf is None:
            raise ConfigError(
                f"model {job.model.name!r} cannot start from a Hugging Face directory "
                "(its Config has no from_hf)",
                path="model.hf_dir",
            )
        try:
            base = from_hf(job.model.hf_dir)
        except (ValueError, KeyError, OSError) as error:
            raise ConfigError(f"{error}", path="model.hf_dir") from error
    else:
        try:
            base = spec.config(job.model.flavor)
        except LookupError as error:
            raise ConfigError(str(error).strip("'\""), path="model.flavor") from error
    user = dict(job.model.config)
    try:
        config = type(base).from_dict(
            {**base.to_dict(), **user}, allow_imports=(*DEFAULT_ALLOWED_IMPORTS, *allow_imports)
        )
    except ConfigError as error:
        raise ConfigError(error.message, path=f"model.config.{error.path}") from error
    if "vocab_size" not in user and not job.model.hf_dir and config.vocab_size < tokenizer_vocab:
        config = config.replace(vocab_size=tokenizer_vocab)
    if config.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"expected a vocabulary of at least the tokenizer's {tokenizer_vocab} ids, found "
            f"vocab_size = {config.vocab_size}",
            path="model.config.vocab_size",
        )
    max_seq_len = getattr(config, "max_seq_len", None)
    if max_seq_len is not None and job.training.seq_len > max_seq_len:
        raise ConfigError(
            f"expected at most the model's max_seq_len ({max_seq_len}), found "
            f"{job.training.seq_len} (raise model.config.max_seq_len)",
            path="training.seq_len",
        )
    _check_model_layout(job, config)
    return config


def _check_model_layout(job: JobConfig, config: Any) -> None:
    """cp and ep need a model that has them: context-parallel attention, routed experts."""
    par, name = job.parallelism, job.model.name
    if par.cp > 1 and not hasattr(config, "context_parallel"):
        raise ConfigError(
            f"expected 1: model {name!r} has no context parallelism (llama-ref has), found {par.cp}",
            path="parallelism.cp",
        )
    if par.ep > 1 and not getattr(config, "num_experts", 0):
        raise ConfigError(
            f"expected 1: model {name!r} ({job.model.flavor or 'default'} flavor) has no "
            f"routed experts (use a MoE flavor, e.g. qwen3-ref's 'debug-moe'), found {par.ep}",
            path="parallelism.ep",
        )
    if par.ep > 1 and config.num_experts % par.ep:
        raise ConfigError(
            f"expected a divisor of model.config.num_experts ({config.num_experts}), found {par.ep}",
            path="parallelism.ep",
        )
    if par.etp > 1 and not getattr(config, "num_experts", 0):
        raise ConfigError(
            f"expected 1: model {name!r} ({job.model.flavor or 'default'} flavor) has no "
            f"routed experts to split over etp, found {par.etp}",
            path="parallelism.etp",
        )
    if par.pp > 1 and getattr(config, "aux_loss_coeff", 0.0) > 0:
        # a pipeline's loss exists on its last stage only; the MoE blocks live on every stage
        raise ConfigError(
            f"expected 0 with parallelism.pp = {par.pp} (the auxiliary loss is not added "
            f"through a pipeline's stages), found {config.aux_loss_coeff}",
            path="model.config.aux_loss_coeff",
        )
    if par.cp > 1 and job.training.seq_len % (2 * par.cp):
        raise ConfigError(
            f"expected a multiple of 2 x parallelism.cp = {2 * par.cp} (each cp rank holds two "
            f"chunks of every sequence), found {job.training.seq_len}",
            path="training.seq_len",
        )


def check_layout(job: JobConfig, world_size: int) -> None:
    """The degrees against the world and what this trainer supports yet (ConfigError naming the key)."""
    job = resolve_world(job, world_size)
    par = job.parallelism
    if par.world_size != world_size:
        raise ConfigError(
            f"expected dp_replicate x dp_shard x cp x tp x pp = the world size {world_size}, "
            f"found {par.dp_replicate} x {par.dp_shard} x {par.cp} x {par.tp} x {par.pp} = "
            f"{par.world_size}",
            path="parallelism",
        )
    parallel_dims(job, world_size)
    batch_layout(job)  # with dp_shard = -1 known only now: the global batch divides by dp
    _check_precision(job)
    if par.pp > 1:
        _check_pipeline_batches(job)


#: ``training.param_dtype`` / ``reduce_dtype`` names and the dtypes they stand for
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_precision(job: JobConfig) -> None:
    """Mixed precision runs where TorchTitan runs it: FSDP's ``MixedPrecisionPolicy`` (any
    ``dp_shard x cp > 1`` layout, pipelines too), else autocast on one process or plain
    replicas."""
    training, par = job.training, job.parallelism
    if training.param_dtype == training.reduce_dtype == "float32":
        return
    fsdp = par.dp_shard * par.cp > 1
    if par.pp > 1 and not fsdp:  # the stages' forward runs in the schedule: no autocast there
        name, found = (
            ("param_dtype", training.param_dtype)
            if training.param_dtype != "float32"
            else ("reduce_dtype", training.reduce_dtype)
        )
        raise ConfigError(
            f"expected float32 with pp = {par.pp} and no FSDP (dp_shard x cp = 1): a "
            f"pipeline's stages run mixed precision through FSDP's MixedPrecisionPolicy, "
            f"found {found!r}",
            path=f"training.{name}",
        )
    if fsdp:
        return  # FSDP's MixedPrecisionPolicy (see mixed_precision_policy)
    if training.reduce_dtype != "float32":
        raise ConfigError(
            f"expected float32 without FSDP (dp_shard x cp = 1): gradients are reduced in the "
            f"weights' float32 unless FSDP reduces them, found {training.reduce_dtype!r}",
            path="training.reduce_dtype",
        )
    if par.tp > 1:
        raise ConfigError(
            f"expected float32 with tp = {par.tp} and no FSDP: mixed precision runs as FSDP's "
            f"MixedPrecisionPolicy (dp_shard x cp > 1) or as torch.autocast on one process or "
            f"plain replicas (dp_replicate), found {training.param_dtype!r}",
            path="training.param_dtype",
        )


def model_job_config(job: JobConfig) -> dict[str, object]:
    """The ``job_config`` a spec's ``parallelize_fn`` / ``pipelining_fn`` gets from the job.

    TorchTitan's activation checkpointing and FSDP policy, and with ``pp > 1`` the
    pipeline's schedule and microbatches (a pipeline hands the rest to each stage's
    ``parallelize_fn``).

    Example::

        >>> model_job_config(JobConfig())["activation_checkpoint"]
        'none'
    """
    options: dict[str, object] = {
        "activation_checkpoint": job.parallelism.activation_checkpoint,
        "mp_policy": mixed_precision_policy(job),
    }
    if job.parallelism.pp > 1:
        options["pipeline"] = {
            "schedule": job.parallelism.pipeline_schedule,
            "n_microbatches": job.parallelism.pipeline_microbatches or job.parallelism.pp,
        }
    return options


def mixed_precision_policy(job: JobConfig) -> MixedPrecisionPolicy | None:
    """FSDP's policy for ``training.param_dtype`` / ``reduce_dtype`` (``None``: no FSDP or float32).

    As TorchTitan: bfloat16 compute copies of the float32 weights, gradients reduced in
    ``reduce_dtype``; the weights, their gradients and AdamW's states stay float32.

    Example::

        >>> mixed_precision_policy(JobConfig().apply_overrides(
        ...     ["training.param_dtype=bfloat16", "parallelism.dp_shard=2"])).param_dtype
        torch.bfloat16
    """
    training, par = job.training, job.parallelism
    if par.dp_shard * par.cp == 1 or training.param_dtype == training.reduce_dtype == "float32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=_DTYPES[training.param_dtype], reduce_dtype=_DTYPES[training.reduce_dtype]
    )


def autocast_dtype(job: JobConfig) -> torch.dtype | None:
    """The dtype the forward runs in under ``torch.autocast`` (``None``: float32 or FSDP's policy).

    Example::

        >>> autocast_dtype(JobConfig().apply_overrides(["training.param_dtype=bfloat16"]))
        torch.bfloat16
    """
    dtype = job.training.param_dtype
    if dtype == "float32" or mixed_precision_policy(job) is not None:
        return None
    return _DTYPES[dtype]


def _check_pipeline_batches(job: JobConfig) -> None:
    """A pipeline splits each rank's batch into equal microbatches: training's and validation's."""
    local_batch, accumulation = batch_layout(job)
    microbatches = job.parallelism.pipeline_microbatches or job.parallelism.pp
    batches = [("parallelism.pipeline_microbatches", "training", local_batch * accumulation)]
    if job.validation.interval:
        batches.append(("validation.interval", "validation", local_batch))
    for key, what, batch in batches:
        if batch % microbatches:
            raise ConfigError(
                f"expected the {what} batch per data-parallel rank ({batch} samples) to divide "
                f"into parallelism.pipeline_microbatches = {microbatches} equal microbatches "
                f"(the pipeline runs {what} on it), found a remainder of {batch % microbatches}",
                path=key,
            )


def check_resume(job: JobConfig) -> int:
    """The step ``--resume`` continues from: the newest committed checkpoint in ``checkpoint.dir``."""
    if not job.checkpoint.dir:
        raise ConfigError(
            "--resume: expected a checkpoint directory, found none", path="checkpoint.dir"
        )
    found = latest_step(job.checkpoint.dir)
    if found is None:
        raise ConfigError(
            f"--resume: expected a committed checkpoint (step-N) in {job.checkpoint.dir!r}, found none",
            path="checkpoint.dir",
        )
    if found >= job.training.steps:
        raise ConfigError(
            f"--resume: expected more steps than the checkpoint's {found}, found "
            f"{job.training.steps} (raise training.steps)",
            path="training.steps",
        )
    return found


def resolve_world(job: JobConfig, world_size: int) -> JobConfig:
    """``job`` with ``parallelism.dp_shard = -1`` replaced by the rest of ``world_size``.

    ``ParallelDims``' rule: ``world_size / (dp_replicate x cp x tp x pp)``; a world that
    does not divide is a ConfigError naming ``parallelism``. Other jobs come back unchanged.

    Example::

        >>> job = JobConfig().apply_overrides(["parallelism.dp_shard=-1", "parallelism.tp=2"])
        >>> resolve_world(job, 8).parallelism.dp_shard
        4
    """
    if job.parallelism.dp_shard != -1:
        return job
    dp_shard = parallel_dims(job, world_size).dp_shard
    return job.replace(parallelism=dataclasses.replace(job.parallelism, dp_shard=dp_shard))


def parallel_dims(job: JobConfig, world_size: int) -> ParallelDims:
    """The job's degrees as a validated :class:`ParallelDims` (ConfigError naming the section)."""
    par = job.parallelism
    try:
        return ParallelDims(
            dp_replicate=par.dp_replicate,
            dp_shard=par.dp_shard,
            cp=par.cp,
            tp=par.tp,
            pp=par.pp,
            ep=par.ep,
            etp=par.etp,
            world_size=world_size,
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error), path="parallelism") from error


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


def _param_groups(model_parts: list[torch.nn.Module], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay for matrices; none for norms, biases (ndim < 2) and embeddings."""
    embeddings: set[int] = set()
    for part in model_parts:
        for module in part.modules():
            # the rule BaseModel.Config.get_nparams_and_flops counts embeddings by
            if isinstance(module, torch.nn.Embedding) or getattr(
                type(module), "is_embedding", False
            ):
                embeddings.update(id(p) for p in module.parameters())
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for part in model_parts:
        for param in part.parameters():
            (no_decay if param.ndim < 2 or id(param) in embeddings else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def load_samples(job: JobConfig, tokenizer: Tokenizer) -> tuple[PackedSamples, PackedSamples]:
    """The training samples and the validation samples (``validation.path`` or a held-out tail)
    of a job on one source (``load_job_data`` reads ``data.mix`` too)."""
    data = load_job_data(job, tokenizer)
    if not isinstance(data.train, PackedSamples) or not isinstance(data.validation, PackedSamples):
        raise ConfigError("load_samples reads one source: use load_job_data", path="data.mix")
    return data.train, data.validation


def train(
    job: JobConfig,
    *,
    resume: bool = False,
    allow_imports: tuple[str, ...] = (),
    log: bool = True,
    stop_file: str = "",
) -> RunSummary | None:
    """Run ``job`` on this rank (inside a process group); rank 0 returns the summary.

    SIGTERM/SIGINT during the steps, or the file ``stop_file`` appearing (how ``hp-train``'s
    launcher passes on a signal it received), ends the run after the current step, saving
    a checkpoint of that step when ``checkpoint.dir`` is set.

    Example::

        >>> run_distributed(train, 2, args=(load_job("job.toml"),))  # doctest: +SKIP
    """
    platform = get_platform()
    rank, world = platform.get_rank(), platform.get_world_size()
    job = resolve_world(job, world)
    check_layout(job, world)
    device_type = job.training.device
    device = platform.device_for(device_type)
    tokenizer = build_tokenizer(job.tokenizer.path)
    model_config = build_model_config(job, tokenizer.vocab_size, allow_imports)
    local_batch, accumulation = batch_layout(job)
    dims = parallel_dims(job, world)
    dims.build_mesh(device_type)
    spec = get_spec(job.model.name)
    with torch.device("meta"):
        model = model_config.build()
    nparams, flops_per_token = model_config.get_nparams_and_flops(model, job.training.seq_len)
    pipe: Pipeline | None = None
    if job.parallelism.pp > 1:
        if spec.pipelining_fn is None:
            raise ConfigError(
                f"model {job.model.name!r} has no pipelining_fn", path="parallelism.pp"
            )
        pipe = spec.pipelining_fn(model, dims, model_job_config(job))
        assert pipe is not None
        torch.manual_seed(job.training.seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            pipe.init_weights(buffer_device=device)
        parts = list(pipe.model_parts)
    else:
        # with neither tp nor fsdp the model stays a plain module (replicas average below)
        if spec.parallelize_fn is not None and (dims.tp_enabled or dims.fsdp_enabled):
            model = spec.parallelize_fn(model, dims, model_job_config(job))
        model.to_empty(device=device)
        torch.manual_seed(job.training.seed)
        with warnings.catch_warnings():
            # random init fills full tensors and keeps this rank's slice, by design
            warnings.simplefilter("ignore", FallbackWarning)
            model.init_weights(buffer_device=device)
        if job.model.hf_dir:
            load_hf(model, job.model.hf_dir)
        parts = [model]
    optimizer = torch.optim.AdamW(
        _param_groups(parts, job.optimizer.weight_decay),
        lr=job.optimizer.lr,
        betas=job.optimizer.betas,
        eps=job.optimizer.eps,
        foreach=False,
    )
    data = load_job_data(job, tokenizer)
    val_samples = data.validation
    dp_rank, dp = dims.batch_mesh.get_local_rank(0), dims.dp
    sampler = Prefetcher(  # the next step's batches are read while a step runs
        make_sampler(
            data.train,
            seed=job.training.seed,
            dp_rank=dp_rank,
            dp=dp,
            local_batch=local_batch,
            accumulation=accumulation,
        )
    )
    state = TrainingState(device=device)
    # a stage keeps the full model's FQNs: each rank saves and loads its own stage's states;
    # optimizer states keyed by FQN too (as TorchTitan), not by group index that stages share
    (held,) = parts  # the trainer's pipelines hold one stage per rank
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    app: dict[str, Any] = {"app": ModelState(held, optimizer, options=options), "train": state}
    if resume:
        check_resume(job)
        loaded = load(app, job.checkpoint.dir)
        saved_model = state.extra.get("model")
        if saved_model not in (None, job.model.name):
            raise ConfigError(
                f"--resume: expected a checkpoint of model {job.model.name!r}, found one of "
                f"{saved_model!r} in {str(step_path(job.checkpoint.dir, loaded))!r}",
                path="checkpoint.dir",
            )
        check_resumed_data(state.extra.get("data"), job, str(step_path(job.checkpoint.dir, loaded)))
        sampler.position = state.data_position
    state.extra["model"] = job.model.name
    state.extra["data"] = data.identity
    resumed_after = state.step if resume else None
    metrics = MetricsLogger(job, rank=rank, resumed_after=resumed_after) if log else None
    tokens_per_step = job.training.global_batch_size * job.training.seq_len
    summary = RunSummary(first_step=state.step + 1)
    # the loss is averaged where the batch is split; replicas that FSDP does not cover average here
    loss_mesh, loss_axes = dims.loss_mesh, ("loss",) if dims.loss_mesh.size() > 1 else ()
    average_over = None if dims.fsdp_enabled or dims.dp == 1 else (dims.batch_mesh, "batch")
    pp_mesh = dims.get_mesh("pp") if dims.pp_enabled else None
    # MoE: token counts are summed over the ranks that route different tokens (the loss view)
    balance_mesh = loss_mesh if loss_mesh.size() > 1 else None
    routed = bool(_moe_layers(parts))  # found once: no walk over the modules every step
    stepped_model: torch.nn.Module | Pipeline = pipe if pipe is not None else model
    if pipe is None and any(m.config.aux_loss_coeff > 0 for m in _moe_layers(parts)):
        stepped_model = _WithAuxLoss(model)
    if metrics is not None:
        metrics.start(nparams=nparams, world=world, first_step=state.step + 1)
    stop = _Stop(stop_file)
    pending: PendingSave | None = None
    profile = _profiler(job, rank, state.step + 1)
    everyone = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    with stop.installed(), profile as profiler:
        for step in range(state.step + 1, job.training.steps + 1):
            start = time.perf_counter()
            microbatches = [_model_inputs(b, device) for b in sampler.next_step()]
            data_seconds = time.perf_counter() - start
            lr = lr_at(step, job.optimizer.lr, job.lr_scheduler)
            for group in optimizer.param_groups:
                group["lr"] = lr
            result: StepResult = train_step(
                stepped_model,
                microbatches,
                optimizer,
                loss_mesh=loss_mesh,
                loss_axes=loss_axes,
                pp_mesh=pp_mesh,
                average_over=average_over,
                max_norm=job.training.max_norm,
                skip_nonfinite=job.training.skip_nonfinite,
                step=step,
                autocast_dtype=autocast_dtype(job),
            )
            if result.stepped and routed:
                for part in parts:
                    update_load_balance(part, balance_mesh)
            seconds = time.perf_counter() - start
            state.step, state.data_position = step, sampler.position
            if profiler is not None:
                profiler.step()
            summary.losses.append(result.loss)
            summary.lrs.append(lr)
            summary.grad_norms.append(result.grad_norm)
            summary.seconds.append(seconds)
            if metrics is not None and (
                step % job.metrics.log_interval == 0 or step == job.training.steps
            ):
                metrics.log_step(
                    StepMetrics(
                        step=step,
                        loss=result.loss,
                        lr=lr,
                        grad_norm=result.grad_norm,
                        tokens_per_second=tokens_per_step / seconds,
                        tflops_per_device=flops_per_token
                        * tokens_per_step
                        / seconds
                        / world
                        / 1e12,
                        data_wait=data_seconds / seconds,
                        epoch=sampler.epoch,
                        memory_gib=_peak_memory_gib(device),
                    ),
                    steps=job.training.steps,
                )
            if job.validation.interval and step % job.validation.interval == 0:
                val = validate(
                    pipe if pipe is not None else model,
                    val_samples,
                    job,
                    loss_mesh,
                    loss_axes,
                    dp_rank,
                    dp,
                    local_batch,
                    device,
                    pp_mesh=pp_mesh,
                )
                summary.val_losses[step] = val
                if metrics is not None:
                    metrics.log_validation(step, val)
            stopping = _agree(stop.requested, everyone, device)
            due = bool(job.checkpoint.dir) and (
                step == job.training.steps
                or (job.checkpoint.interval and step % job.checkpoint.interval == 0)
                or stopping
            )
            if due:
                if pending is not None:
                    pending.wait()
                saved = save(
                    app,
                    job.checkpoint.dir,
                    step=step,
                    async_save=job.checkpoint.async_save and not stopping,
                )
                if isinstance(saved, PendingSave):
                    pending = saved
                    summary.last_checkpoint = str(saved.path)
                else:
                    pending = None
                    summary.last_checkpoint = str(saved)
                    _keep_last(job, rank)
                if metrics is not None:
                    metrics.note(f"checkpoint {summary.last_checkpoint}")
            if stopping:
                summary.stopped_by_signal = True
                if metrics is not None:
                    metrics.note(f"stopped by a signal after step {step}; resume with --resume")
                break
    sampler.close()
    if pending is not None:
        pending.wait()
        _keep_last(job, rank)
    if job.checkpoint.export_hf:
        if pp_mesh is None:
            save_hf(model, job.checkpoint.export_hf)
        else:
            whole = _gather_stages(model, parts, pp_mesh, rank, device)
            save_hf(whole, job.checkpoint.export_hf)
        if metrics is not None:
            metrics.note(f"exported Hugging Face weights to {job.checkpoint.export_hf}")
    if metrics is not None:
        metrics.finish(summary)
    return summary if rank == 0 else None


def _gather_stages(
    whole: torch.nn.Module,
    parts: list[torch.nn.Module],
    pp_mesh: DeviceMesh,
    rank: int,
    device: torch.device,
) -> torch.nn.Module:
    """``whole`` (the model built on the meta device) holding every stage's states on rank 0.

    Collective over every rank. State by state in ``whole``'s order, the stage that holds
    it gathers it whole (``full_tensor`` over its own mesh) and its ``pp`` rank broadcasts
    it over ``pp``; rank 0 alone allocates ``whole`` (on the CPU) and keeps the values.
    The other ranks return ``whole`` still on the meta device: :func:`save_hf` reads
    values on rank 0 only.
    """
    held: dict[str, torch.Tensor] = {}
    for part in parts:
        held.update(part.state_dict())
    names = list(whole.state_dict())
    me = pp_mesh.get_local_rank("pp")
    owners = torch.tensor([me if n in held else -1 for n in names], device=device)
    owners = collectives.all_reduce(owners, pp_mesh, "pp", "max")
    if rank == 0:
        whole.to_empty(device="cpu")
    values = whole.state_dict()
    for name, owner in zip(names, owners.tolist(), strict=True):
        if owner < 0:
            raise ValueError(
                f"checkpoint.export_hf: expected a pipeline stage holding {name!r}, found none"
            )
        mine = held.get(name)
        if isinstance(mine, DTensor):
            mine = mine.full_tensor()  # every rank of the owning stage, in the same order
        shape, dtype = values[name].shape, values[name].dtype
        sent = (
            mine.detach().contiguous()
            if mine is not None
            else torch.empty(shape, dtype=dtype, device=device)
        )
        got = collectives.broadcast(sent, pp_mesh, "pp", int(owner))
        if rank == 0:
            values[name].copy_(got)
    return whole


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

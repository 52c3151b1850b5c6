"""The job's model: its Config, built on the meta device, parallelized or pipelined onto the device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims, get_spec
from hyper_parallel.dmodule.checkpoint import load_hf
from hyper_parallel.dmodule.pipeline import Pipeline
from hyper_parallel.dtensor import FallbackWarning
from hyper_parallel.train.checks import check_model_layout
from hyper_parallel.train.config import DEFAULT_ALLOWED_IMPORTS, JobConfig
from hyper_parallel.train.metrics import StartupTimes
from hyper_parallel.train.precision import mixed_precision_policy

__all__ = ["BuiltModel", "build_model", "build_model_config", "build_optimizer", "model_job_config"]


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
    if job.parallelism.compile:
        config = _compiled(job, config)
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
    check_model_layout(job, config)
    return config


def _compiled(job: JobConfig, config: Any) -> Any:
    """``[parallelism] compile = true``: the model's ``local_map`` regions run compiled.

    It sets the model Config's ``compile_local_map`` (llama-ref, qwen3-ref); a model without
    it, or one without its regions (``use_local_map`` false: llama-ref's or qwen3-ref's
    default, nothing to compile), is refused by name.
    """
    name = job.model.name
    if not hasattr(config, "compile_local_map"):
        raise ConfigError(
            f"expected false: model {name!r} has no compiled regions (its Config has no "
            "compile_local_map), found true",
            path="parallelism.compile",
        )
    if getattr(config, "use_local_map", True) is False:
        raise ConfigError(
            "expected model.config.use_local_map = true with parallelism.compile = true (it "
            f"compiles the local_map regions of model {name!r}), found use_local_map = false",
            path="parallelism.compile",
        )
    return config.replace(compile_local_map=True)


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


@dataclass
class BuiltModel:
    """The model of one rank: ``parts`` hold its weights on the device.

    ``model`` is the whole model (left on the meta device under a pipeline, whose
    ``pipe.model_parts`` are this rank's stages); ``nparams`` and ``flops_per_token`` are
    the whole model's.
    """

    model: torch.nn.Module
    pipe: Pipeline | None
    parts: list[torch.nn.Module]
    nparams: int
    flops_per_token: float


def build_model(
    job: JobConfig,
    model_config: Any,
    dims: ParallelDims,
    device: torch.device,
    times: StartupTimes,
) -> BuiltModel:
    """Build on meta, parallelize (or cut into pipeline stages), allocate and initialize.

    With ``model.hf_dir`` the initialized weights are then replaced by the Hugging Face
    ones. Each part is timed into ``times`` (``build``, ``parallelize``, ``hf load``).

    Example::

        built = build_model(job, build_model_config(job, 257), dims, device, StartupTimes())
    """
    spec = get_spec(job.model.name)
    with times.phase("build"), torch.device("meta"):
        model = model_config.build()
    nparams, flops_per_token = model_config.get_nparams_and_flops(model, job.training.seq_len)
    with times.phase("parallelize"):
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
            # with neither tp nor fsdp the model stays a plain module (replicas average later)
            if spec.parallelize_fn is not None and (dims.tp_enabled or dims.fsdp_enabled):
                model = spec.parallelize_fn(model, dims, model_job_config(job))
            model.to_empty(device=device)
            torch.manual_seed(job.training.seed)
            with warnings.catch_warnings():
                # random init fills full tensors and keeps this rank's slice, by design
                warnings.simplefilter("ignore", FallbackWarning)
                model.init_weights(buffer_device=device)
            parts = [model]
    if job.model.hf_dir and pipe is None:
        with times.phase("hf load"):
            load_hf(model, job.model.hf_dir)
    return BuiltModel(model, pipe, parts, nparams, flops_per_token)


def build_optimizer(job: JobConfig, parts: list[torch.nn.Module]) -> torch.optim.AdamW:
    """AdamW over ``parts``' parameters (see :func:`param_groups`)."""
    return torch.optim.AdamW(
        param_groups(parts, job.optimizer.weight_decay),
        lr=job.optimizer.lr,
        betas=job.optimizer.betas,
        eps=job.optimizer.eps,
        foreach=False,
    )


def param_groups(model_parts: list[torch.nn.Module], weight_decay: float) -> list[dict[str, Any]]:
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

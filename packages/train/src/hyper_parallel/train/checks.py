"""Checks of a job before it runs: its degrees against the world, the model's layout, precision."""

from __future__ import annotations

import dataclasses
from typing import Any

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.train.config import JobConfig, batch_layout

__all__ = [
    "check_layout",
    "check_model_layout",
    "parallel_dims",
    "resolve_world",
]


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


def check_model_layout(job: JobConfig, config: Any) -> None:
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

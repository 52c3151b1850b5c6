"""JobConfig: the job's sections as one hp-config tree, read from TOML plus dotted overrides."""

from __future__ import annotations

import codecs
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hyper_parallel.config import ConfigError, Configurable, load_config

__all__ = [
    "DEFAULT_ALLOWED_IMPORTS",
    "CheckpointConfig",
    "DataConfig",
    "JobConfig",
    "LRSchedulerConfig",
    "MetricsConfig",
    "MixSource",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "ValidationConfig",
    "load_job",
    "to_toml",
]

#: Modules a job file may name callables from (``"module:function"``); ``--allow-import``
#: adds more. A job file is data: ``os:system`` or ``builtins:eval`` are refused.
DEFAULT_ALLOWED_IMPORTS: tuple[str, ...] = (
    "torch.nn.init",
    "torch.nn.functional",
    "hyper_parallel",
)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """``[model]``: a spec of the registry, its flavor, field overrides, an HF start."""

    name: str = "llama-ref"
    flavor: str = "debug"
    #: fields of the model's Config, over the flavor's (``[model.config]`` in TOML)
    config: dict[str, Any] = field(default_factory=dict)
    #: a Hugging Face directory (config.json + safetensors) to start from (fine-tuning)
    hf_dir: str = ""


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """``[parallelism]``: the ``ParallelDims`` degrees, pipeline, activation checkpointing, compile."""

    dp_replicate: int = 1
    #: -1: the rest of the world (world size / the other degrees), as ``ParallelDims``
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    pipeline_schedule: str = "1F1B"
    #: microbatches per pipeline step (0: the ``pp`` degree)
    pipeline_microbatches: int = 0
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    compile: bool = False

    @property
    def world_size(self) -> int:
        """The product of the degrees (``ep``/``etp`` refactor the others' ranks); -1 while
        ``dp_shard`` is -1 (the world decides it)."""
        if self.dp_shard == -1:
            return -1
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """The ranks that read different data."""
        return self.dp_replicate * self.dp_shard


@dataclass(kw_only=True, slots=True)
class MixSource:
    """One source of ``data.mix``: a prepared directory (or anything ``data.path`` reads) and its weight."""

    path: str = ""
    #: the share of the samples drawn from this source (weights are normalized to sum 1)
    weight: float = 1.0


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """``[data]``: where the text comes from ("" is the built-in corpus)."""

    #: a file, a directory, a glob, a ``datasets`` directory (``save_to_disk``), or a directory
    #: written by ``hp-train prepare`` (its ``index.json``); "": the built-in corpus
    path: str = ""
    #: "tokens": ``path`` must be a prepared directory ("auto" recognises one too)
    format: Literal["auto", "text", "jsonl", "hf", "tokens"] = "auto"
    #: the JSONL / datasets field holding the text
    field: str = "text"
    #: with no validation.path, this share of the samples (their tail) is held out
    holdout: float = 0.05
    #: the text files' encoding
    encoding: str = "utf-8"
    #: "check": a file with more than 1% undecodable characters is refused (fewer are replaced
    #: by U+FFFD and counted); "replace": replaced and counted, never refused
    decode_errors: Literal["check", "replace"] = "check"
    #: several sources, each sample drawn from one in proportion to its weight (``data.path``
    #: stays ""): ``mix = [{path = "web/", weight = 0.7}, {path = "code/", weight = 0.3}]``
    mix: list[MixSource] = dataclasses.field(default_factory=list)
    #: ``--resume`` onto a checkpoint trained on other prepared data than this job's: refused
    #: unless true
    resume_on_other_data: bool = False


@dataclass(kw_only=True, slots=True)
class TokenizerConfig:
    """``[tokenizer]``: "" is the byte tokenizer (ids 0-255, EOS 256); else a ``tokenizer.json``."""

    path: str = ""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """``[optimizer]``: AdamW; norms, biases and embeddings get no weight decay."""

    name: Literal["AdamW"] = "AdamW"
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass(kw_only=True, slots=True)
class LRSchedulerConfig:
    """``[lr_scheduler]``: linear warmup, then decay over ``decay_steps`` to ``min_lr_ratio * lr``.

    Without ``decay_steps`` the rate is constant after warmup: the schedule never depends on
    ``training.steps``, so a resumed run with more steps sees the same rates.
    """

    warmup_steps: int = 0
    decay_steps: int | None = None
    decay: Literal["cosine", "linear", "wsd"] = "cosine"
    min_lr_ratio: float = 0.0
    #: WSD: the last share of ``decay_steps`` that decays (linearly); before it the rate is stable
    wsd_decay_ratio: float = 0.1


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """``[training]``: steps, batch, sequence length, precision, clipping, seed."""

    steps: int = 100
    global_batch_size: int = 8
    #: samples per data-parallel rank per microbatch (None: global / (dp x accumulation))
    local_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    seq_len: int = 64
    #: the compute dtype: ``bfloat16`` is FSDP's ``MixedPrecisionPolicy`` with FSDP, else the
    #: forward under ``torch.autocast`` (weights, gradients and optimizer states stay float32)
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: the dtype FSDP reduces gradients in (float32 without FSDP: see the README)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    max_norm: float = 1.0
    seed: int = 0
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    #: skip a step whose loss is not finite (default: stop the run naming the step)
    skip_nonfinite: bool = False
    #: seconds before a stalled rank is reported and the run stopped (built-in launcher)
    timeout: float = 600.0


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """``[checkpoint]``: DCP checkpoints in ``dir/step-N`` every ``interval`` steps, keep the last K."""

    dir: str = ""
    interval: int = 0
    keep: int = 0  # 0 keeps all
    async_save: bool = False
    #: write the final model as Hugging Face safetensors here
    export_hf: str = ""
    #: ``--resume`` continues from this step's checkpoint (0: the newest)
    resume_step: int = 0
    #: a fresh run (no ``--resume``) removes ``dir``'s checkpoints first; without it, a fresh
    #: run into a ``dir`` holding checkpoints is refused
    overwrite: bool = False


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """``[metrics]``: log cadence, TensorBoard, JSONL, the PNG at the end, the device's peak."""

    log_interval: int = 1
    tensorboard_dir: str = ""
    jsonl: str = ""
    plot: str = ""
    #: the device's peak TFLOPs for MFU (0: from the table of known accelerators)
    peak_tflops: float = 0.0


@dataclass(kw_only=True, slots=True)
class ValidationConfig:
    """``[validation]``: every ``interval`` steps, ``steps`` batches of held-out data."""

    interval: int = 0
    steps: int = 1
    path: str = ""


@dataclass(kw_only=True, slots=True)
class ProfilingConfig:
    """``[profiling]``: a torch.profiler trace of steps ``start_step`` to ``end_step`` into ``dir``."""

    dir: str = ""
    start_step: int = 0
    end_step: int = 0


class Job(Configurable):
    """The owner of :class:`JobConfig` (``JobConfig().build()`` gives it; the trainer reads it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """One training job: every section of ``job.toml``.

        Example::

            >>> JobConfig().apply_overrides(["training.steps=5"]).training.steps
            5
        """

        model: ModelConfig = field(default_factory=ModelConfig)
        parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
        data: DataConfig = field(default_factory=DataConfig)
        tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
        lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
        training: TrainingConfig = field(default_factory=TrainingConfig)
        checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
        metrics: MetricsConfig = field(default_factory=MetricsConfig)
        validation: ValidationConfig = field(default_factory=ValidationConfig)
        profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def __init__(self, *, config: Job.Config) -> None:
        self.config = config


JobConfig = Job.Config


def load_job(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    allow_imports: Iterable[str] = (),
) -> JobConfig:
    """The job of a TOML file (or the defaults, ``path=None``) with dotted overrides, checked.

    Callables resolve only from :data:`DEFAULT_ALLOWED_IMPORTS` and ``allow_imports``.

    Example::

        >>> load_job(None, ["training.seq_len=32"]).training.seq_len
        32
    """
    allowed = (*DEFAULT_ALLOWED_IMPORTS, *allow_imports)
    if path is None:
        job = JobConfig().apply_overrides(list(overrides), allow_imports=allowed)
    else:
        job = load_config(path, JobConfig, list(overrides), allow_imports=allowed)
    check_job(job)
    return job


def check_job(job: JobConfig) -> None:
    """Values that type-check but cannot make a run: a ConfigError naming the key.

    Example::

        >>> check_job(JobConfig().apply_overrides(["training.steps=0"]))
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: training.steps: expected an int >= 1, found 0
    """
    at_least = {
        "training.steps": (job.training.steps, 1),
        "training.seq_len": (job.training.seq_len, 1),
        "training.global_batch_size": (job.training.global_batch_size, 1),
        "training.gradient_accumulation_steps": (job.training.gradient_accumulation_steps, 1),
        "parallelism.dp_replicate": (job.parallelism.dp_replicate, 1),
        "parallelism.cp": (job.parallelism.cp, 1),
        "parallelism.tp": (job.parallelism.tp, 1),
        "parallelism.pp": (job.parallelism.pp, 1),
        "parallelism.ep": (job.parallelism.ep, 1),
        "parallelism.etp": (job.parallelism.etp, 1),
        "parallelism.pipeline_microbatches": (job.parallelism.pipeline_microbatches, 0),
        "lr_scheduler.warmup_steps": (job.lr_scheduler.warmup_steps, 0),
        "checkpoint.interval": (job.checkpoint.interval, 0),
        "checkpoint.keep": (job.checkpoint.keep, 0),
        "checkpoint.resume_step": (job.checkpoint.resume_step, 0),
        "metrics.log_interval": (job.metrics.log_interval, 1),
        "validation.interval": (job.validation.interval, 0),
        "validation.steps": (job.validation.steps, 1),
    }
    for key, (value, low) in at_least.items():
        if value < low:
            raise ConfigError(f"expected an int >= {low}, found {value}", path=key)
    if job.parallelism.dp_shard < 1 and job.parallelism.dp_shard != -1:
        raise ConfigError(
            f"expected an int >= 1 or -1 (the rest of the world), found {job.parallelism.dp_shard}",
            path="parallelism.dp_shard",
        )
    if job.lr_scheduler.decay_steps is not None and job.lr_scheduler.decay_steps < 1:
        raise ConfigError(
            f"expected an int >= 1 or no value, found {job.lr_scheduler.decay_steps}",
            path="lr_scheduler.decay_steps",
        )
    positive = {
        "optimizer.lr": job.optimizer.lr,
        "training.max_norm": job.training.max_norm,
    }
    for key, number in positive.items():
        if not (math.isfinite(number) and number > 0):
            raise ConfigError(f"expected a finite float > 0, found {number}", path=key)
    fractions = {
        "lr_scheduler.min_lr_ratio": job.lr_scheduler.min_lr_ratio,
        "lr_scheduler.wsd_decay_ratio": job.lr_scheduler.wsd_decay_ratio,
    }
    for key, number in fractions.items():
        if not 0.0 <= number <= 1.0:
            raise ConfigError(f"expected a float in [0, 1], found {number}", path=key)
    check_data_config(job)
    if job.training.param_dtype == "float16":
        raise ConfigError(
            "expected bfloat16 or float32 (float16 needs loss scaling, which hp-train does not "
            "run), found 'float16'",
            path="training.param_dtype",
        )
    if job.parallelism.dp_shard != -1:  # else once the world is known (resolve_world)
        batch_layout(job)  # raises on a batch that does not divide


def check_data_config(job: JobConfig) -> None:
    """``[data]``'s values that cannot make a run: a ConfigError naming the key.

    Example::

        >>> check_data_config(JobConfig().apply_overrides(["data.holdout=1"]))
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: data.holdout: expected a share in [0, 1) of the samples to hold out for validation (1 leaves none to train on), found 1.0
    """
    data = job.data
    holdout = data.holdout
    if not (math.isfinite(holdout) and 0.0 <= holdout < 1.0):
        raise ConfigError(
            "expected a share in [0, 1) of the samples to hold out for validation (1 leaves "
            f"none to train on), found {holdout}",
            path="data.holdout",
        )
    if job.validation.interval and not job.validation.path and holdout == 0.0:
        raise ConfigError(
            f"validation.interval = {job.validation.interval} validates on the held-out tail: "
            "expected a share in (0, 1), or a validation.path, found 0.0",
            path="data.holdout",
        )
    try:
        codecs.lookup(data.encoding)
    except LookupError:
        raise ConfigError(
            f"expected a text encoding Python knows (utf-8, latin-1, cp1252, ...), found "
            f"{data.encoding!r}",
            path="data.encoding",
        ) from None
    if data.mix and data.path:
        raise ConfigError(
            f"expected either data.path or data.mix, found both (data.path = {data.path!r})",
            path="data.mix",
        )
    for number, source in enumerate(data.mix):
        if not source.path:
            raise ConfigError(
                "expected a prepared directory, found ''", path=f"data.mix[{number}].path"
            )
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise ConfigError(
                f"expected a finite weight > 0, found {source.weight}",
                path=f"data.mix[{number}].weight",
            )


def batch_layout(job: JobConfig) -> tuple[int, int]:
    """``(local batch, gradient-accumulation steps)``: ``global = dp x local x accumulation``.

    Example::

        >>> batch_layout(JobConfig().apply_overrides(["training.global_batch_size=8",
        ...                                           "training.gradient_accumulation_steps=2"]))
        (4, 2)
    """
    training, dp = job.training, job.parallelism.dp
    if job.parallelism.dp_shard == -1:
        raise ConfigError(
            "expected the number of data-parallel ranks: -1 (the rest of the world) is resolved "
            "with the world size first (hyper_parallel.train.trainer.resolve_world)",
            path="parallelism.dp_shard",
        )
    if training.local_batch_size is not None:
        local = training.local_batch_size
        if local < 1 or training.global_batch_size % (dp * local):
            raise ConfigError(
                f"expected global_batch_size ({training.global_batch_size}) to divide by dp "
                f"(dp_replicate x dp_shard = {dp}) x local_batch_size ({local}), found "
                f"{training.global_batch_size} % {dp * local} = "
                f"{training.global_batch_size % max(dp * local, 1)}",
                path="training.global_batch_size",
            )
        accumulation = training.global_batch_size // (dp * local)
        explicit = training.gradient_accumulation_steps
        if explicit not in (1, accumulation):
            raise ConfigError(
                f"expected {accumulation} (global / (dp x local_batch_size)) or 1, found "
                f"{explicit}",
                path="training.gradient_accumulation_steps",
            )
        return local, accumulation
    accumulation = training.gradient_accumulation_steps
    if training.global_batch_size % (dp * accumulation):
        raise ConfigError(
            f"expected global_batch_size ({training.global_batch_size}) to divide by dp "
            f"(dp_replicate x dp_shard = {dp}) x gradient_accumulation_steps ({accumulation}), "
            f"found a remainder of {training.global_batch_size % (dp * accumulation)}",
            path="training.global_batch_size",
        )
    return training.global_batch_size // (dp * accumulation), accumulation


def to_toml(job: JobConfig) -> str:
    """``job`` as TOML that reads back (:func:`load_job`) to an equal config.

    Example::

        >>> print(to_toml(JobConfig()).splitlines()[0])
        [model]
    """
    return _tables(job.to_dict(), ())


def _tables(data: Mapping[str, Any], prefix: tuple[str, ...]) -> str:
    scalars = {k: v for k, v in data.items() if not isinstance(v, Mapping) and v is not None}
    nested = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    lines: list[str] = []
    if prefix and (scalars or not nested):
        lines.append(f"[{'.'.join(_key(p) for p in prefix)}]")
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    text = "\n".join(lines) + ("\n" if lines else "")
    for key, value in nested.items():
        text += ("\n" if text else "") + _tables(value, (*prefix, key))
    return text


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else _string(key)


def _string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        inner = ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None)
        return "{" + inner + "}"
    raise ConfigError(f"cannot write {value!r} as TOML")

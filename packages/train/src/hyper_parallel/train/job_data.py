"""A job's data: its training and validation samples from text, prepared shards or a mixture.

``data.path`` may name text (tokenized at startup, in memory) or a directory written by
``hp-train prepare`` (memory-mapped, nothing tokenized); ``data.mix`` several sources
with weights. Either way the samples are :class:`~.data.PackedSamples` over a token
stream, so the same text gives the same samples. :func:`data_identity` is what a
checkpoint records of the data, :func:`check_resumed_data` what ``--resume`` compares.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

from hyper_parallel.config import ConfigError
from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.data import BatchSampler, PackedSamples, pack
from hyper_parallel.train.documents import (
    DecodeReport,
    builtin_corpus,
    find_files,
    is_hf_dataset,
    read_documents,
)
from hyper_parallel.train.mixture import Mixture, MixtureSampler
from hyper_parallel.train.shards import ShardedTokens, is_prepared, read_index
from hyper_parallel.train.tokenizer import Tokenizer

__all__ = [
    "JobData",
    "UndecodableTextWarning",
    "check_data",
    "check_resumed_data",
    "data_identity",
    "load_job_data",
    "make_sampler",
]


class UndecodableTextWarning(UserWarning):
    """Some characters of the text could not be decoded and were replaced by U+FFFD."""


@dataclass(frozen=True)
class JobData:
    """The training and validation samples of a job, and the identity of its prepared data."""

    train: PackedSamples | Mixture
    validation: PackedSamples | Mixture
    #: "" for text tokenized at startup; else see :func:`data_identity`
    identity: str


def _prepared(path: str, job: JobConfig, key: str) -> bool:
    """Whether ``path`` is read as prepared shards (``data.format = "tokens"`` insists)."""
    if job.data.format == "tokens":
        read_index(path, key=key)  # a clear error when it is not
        return True
    return job.data.format == "auto" and is_prepared(path)


def load_samples_of(path: str, job: JobConfig, tokenizer: Tokenizer, key: str) -> PackedSamples:
    """The samples of one source: memory-mapped when prepared, else tokenized now."""
    data, seq_len = job.data, job.training.seq_len
    if path and _prepared(path, job, key):
        index = read_index(path, key=key)
        index.check_tokenizer(job.tokenizer.path, key=key)
        return PackedSamples(ShardedTokens(index), seq_len)
    report = DecodeReport()
    documents = read_documents(
        path,
        format=data.format,
        field=data.field,
        key=key,
        encoding=data.encoding,
        decode_errors=data.decode_errors,
        report=report,
    )
    samples = pack(documents, tokenizer, seq_len=seq_len)
    if report.total:
        warnings.warn(f"{key}: {report.summary()}", UndecodableTextWarning, stacklevel=2)
    return samples


def _split(samples: PackedSamples, holdout: float) -> tuple[PackedSamples, PackedSamples]:
    n = len(samples)
    tail = max(1, int(n * holdout)) if holdout > 0 and n > 1 else 0
    return samples.subset(0, n - tail), samples.subset(n - tail, n)


def load_job_data(job: JobConfig, tokenizer: Tokenizer) -> JobData:
    """The job's training and validation samples (``validation.path`` or the held-out tail).

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> data = load_job_data(JobConfig(), ByteTokenizer())
        >>> len(data.train) > len(data.validation) > 0
        True
    """
    holdout = job.data.holdout
    if job.data.mix:
        names = tuple(source.path for source in job.data.mix)
        splits = [
            _split(load_samples_of(s.path, job, tokenizer, f"data.mix[{i}].path"), holdout)
            for i, s in enumerate(job.data.mix)
        ]
        weights = tuple(source.weight for source in job.data.mix)
        mixed = Mixture(tuple(t for t, _ in splits), weights, names)
        validation: PackedSamples | Mixture = Mixture(tuple(v for _, v in splits), weights, names)
        if job.validation.path:
            validation = load_samples_of(job.validation.path, job, tokenizer, "validation.path")
        return JobData(mixed, validation, data_identity(job))
    everything = load_samples_of(job.data.path, job, tokenizer, "data.path")
    if job.validation.path:
        held = load_samples_of(job.validation.path, job, tokenizer, "validation.path")
        return JobData(everything, held, data_identity(job))
    train, held = _split(everything, holdout)
    return JobData(train, held, data_identity(job))


def make_sampler(
    samples: PackedSamples | Mixture,
    *,
    seed: int,
    dp_rank: int,
    dp: int,
    local_batch: int,
    accumulation: int,
    shuffle: bool = True,
) -> BatchSampler | MixtureSampler:
    """The sampler of ``samples``: a :class:`Mixture`'s or one set's.

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> samples = pack(["x" * 40], ByteTokenizer(), seq_len=4)
        >>> type(make_sampler(samples, seed=0, dp_rank=0, dp=1, local_batch=2, accumulation=1))
        <class 'hyper_parallel.train.data.BatchSampler'>
    """
    options = {"seed": seed, "dp_rank": dp_rank, "dp": dp, "local_batch": local_batch}
    sampler: BatchSampler | MixtureSampler
    if isinstance(samples, Mixture):
        sampler = MixtureSampler(samples, **options, accumulation=accumulation, shuffle=shuffle)
    else:
        sampler = BatchSampler(samples, **options, accumulation=accumulation, shuffle=shuffle)
    return sampler


def data_identity(job: JobConfig) -> str:
    """What a checkpoint records of the job's data: the SHA-256 of the prepared directories'
    ``index.json`` (with a mixture's weights); "" for text tokenized at startup.

    Reads only ``index.json``.

    Example::

        >>> data_identity(JobConfig())
        ''
    """
    if job.data.mix:
        parts = []
        for i, source in enumerate(job.data.mix):
            key = f"data.mix[{i}].path"
            found = (
                read_index(source.path, key=key).identity
                if _prepared(source.path, job, key)
                else ""
            )
            parts.append(f"{found or source.path}:{source.weight!r}")
        return "mix:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()
    if job.data.path and _prepared(job.data.path, job, "data.path"):
        return read_index(job.data.path).identity
    return ""


def check_resumed_data(saved: object, job: JobConfig, checkpoint: str) -> None:
    """Refuse ``--resume`` onto a checkpoint trained on other prepared data than the job's.

    ``saved`` is the checkpoint's :func:`data_identity` (None: a checkpoint that recorded
    none). ``data.resume_on_other_data = true`` accepts any.
    """
    if saved is None or job.data.resume_on_other_data:
        return
    current = data_identity(job)
    if saved != current:

        def shown(identity: object) -> str:
            return (
                f"prepared data {str(identity)[:16]}" if identity else "text tokenized at startup"
            )

        raise ConfigError(
            f"--resume: the checkpoint {checkpoint!r} was trained on {shown(saved)}, this job "
            f"reads {shown(current)} (data.path = {job.data.path!r}): expected the same data "
            "(set data.resume_on_other_data = true to continue on other data anyway)",
            path="data.path",
        )


def check_data(job: JobConfig) -> None:
    """Everything about the job's data checkable before a process starts (the launcher's preflight).

    Prepared directories: ``index.json``, their files' sizes, the tokenizer and that
    ``seq_len`` fits the tokens (nothing but ``index.json`` is read); text: that the paths
    name files.
    """
    sources = [(s.path, f"data.mix[{i}].path") for i, s in enumerate(job.data.mix)]
    if not job.data.mix:
        sources.append((job.data.path, "data.path"))
    if job.validation.path:
        sources.append((job.validation.path, "validation.path"))
    for path, key in sources:
        if path and _prepared(path, job, key):
            index = read_index(path, key=key)
            index.check_tokenizer(job.tokenizer.path, key=key)
            if index.tokens < job.training.seq_len + 1:
                raise ValueError(
                    f"{key} = {path!r}: expected at least one sample of training.seq_len "
                    f"{job.training.seq_len} + 1 tokens, found {index.tokens} tokens"
                )
        elif path:
            if not is_hf_dataset(Path(path)):  # a datasets directory is read by datasets
                find_files(path, key=key)
        else:
            builtin_corpus()

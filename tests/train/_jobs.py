"""Tiny jobs for hp-train's tests: a small corpus on disk and a one-block llama-ref."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch

from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import build_model_config

#: A model small enough that a 2-rank step takes milliseconds.
TINY_MODEL = [
    'model.config={"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 32, '
    '"max_seq_len": 16}',
    "training.seq_len=16",
    "training.global_batch_size=4",
    "optimizer.lr=0.01",
    "lr_scheduler.warmup_steps=2",
    "data.holdout=0.1",
]


_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "red",
    "owls",
    "sing",
]


def write_corpus(directory: Path, documents: int = 12) -> Path:
    """``documents`` text files of varied English-like sentences (a few KB), deterministic."""
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        sentence = " ".join(_WORDS[(d * 5 + i * 3) % len(_WORDS)] for i in range(60))
        (directory / f"doc{d:02d}.txt").write_text(f"Document {d}. {sentence}.\n")
    return directory


def write_aligned_corpus(directory: Path, seq_len: int = 16, documents: int = 24) -> Path:
    """Documents whose bytes + EOS fill whole samples of ``seq_len``: no sample packs two documents.

    Each document's length is a multiple of ``seq_len`` tokens, so every sample's
    ``document_ids`` are all 0 (a pipeline does not carry them between stages).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        text = " ".join(f"{word}{d % (i + 2)}" for i, word in enumerate(_WORDS * 4))
        length = seq_len * (3 + d % 4) - 1  # + EOS: a multiple of seq_len
        (directory / f"doc{d:02d}.txt").write_text((text * 2)[:length])
    return directory


def tiny_job(corpus: Path, *overrides: str) -> JobConfig:
    """The tiny model on ``corpus`` with ``overrides`` on top."""
    return JobConfig().apply_overrides([*TINY_MODEL, f"data.path={corpus}", *overrides])


Model = TypeVar("Model", bound=BaseModel)


def initial_model(job: JobConfig, kind: type[Model]) -> Model:
    """The job's model (a ``kind``) as the trainer starts it, in one process: the oracles'
    starting point (built on meta, materialized on the CPU, initialized after ``training.seed``)."""
    with torch.device("meta"):
        model = build_model_config(job, ByteTokenizer().vocab_size).build()
    assert isinstance(model, kind), f"{job.model.name}: expected a {kind.__name__}, found {model!r}"
    model.to_empty(device="cpu")
    torch.manual_seed(job.training.seed)
    model.init_weights(buffer_device=torch.device("cpu"))
    return model

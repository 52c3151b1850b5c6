"""Data: documents from text, JSONL or ``datasets`` directories, packed with document ids, sharded.

Documents are tokenized, each followed by EOS, joined into one stream and cut into
samples of ``seq_len`` tokens (targets: the next ``seq_len``). A sample keeps its
``document_ids`` (0, 1, ... in the order its documents start) so that attention can stay
inside documents. :class:`BatchSampler` walks seeded permutations of the samples, epoch
after epoch; each data-parallel rank takes its own rows of every global batch, and its
position (samples consumed) is all it needs to continue exactly after a resume.
"""

from __future__ import annotations

import glob
import importlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.train.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "BatchSampler",
    "PackedSamples",
    "builtin_corpus",
    "find_files",
    "pack",
    "read_documents",
]

#: The built-in corpus's size: enough text for a small model, tokenized in well under a second.
BUILTIN_CORPUS_BYTES = 2_000_000


@dataclass(frozen=True)
class Batch:
    """One microbatch of one rank: ``tokens``, ``targets`` and ``document_ids``, ``(batch, seq)``."""

    tokens: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        return Batch(self.tokens.to(device), self.targets.to(device), self.document_ids.to(device))


def builtin_corpus() -> list[Path]:
    """The built-in corpus: the first ~2 MB of the Python standard library's own sources.

    Found at run time (no download, nothing shipped); the same files on every rank.

    Example::

        >>> all(path.suffix == ".py" for path in builtin_corpus())
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= BUILTIN_CORPUS_BYTES:
            break
    if not files:
        raise FileNotFoundError(f"data.path = '': no Python sources in the standard library {root}")
    return files


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def find_files(path: str, *, key: str = "data.path") -> list[Path]:
    """The files ``path`` names: a file, every file under a directory, or a glob's matches.

    Example::

        >>> find_files("/nonexistent/*.txt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: data.path = '/nonexistent/*.txt': expected a file, a directory or a glob matching files, found no match
    """
    target = Path(path)
    if target.is_file():
        return [target]
    if target.is_dir():
        found = [p for p in sorted(target.rglob("*")) if p.is_file() and not _hidden(p, target)]
    else:
        found = [Path(p) for p in sorted(glob.glob(path, recursive=True)) if Path(p).is_file()]
    if not found:
        raise FileNotFoundError(
            f"{key} = {path!r}: expected a file, a directory or a glob matching files, "
            "found no match"
        )
    return found


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def read_documents(
    path: str, *, format: str = "auto", field: str = "text", key: str = "data.path"
) -> Iterator[str]:
    """The documents of ``path``: each text file, each JSONL line's ``field``, each dataset row's.

    ``""`` is the built-in corpus. ``format`` ``"auto"`` reads ``.jsonl``/``.json`` files as
    JSONL, a ``save_to_disk`` directory as a dataset and anything else as text.

    Example::

        >>> isinstance(next(read_documents("")), str)
        True
    """
    if path and (format == "hf" or (format == "auto" and _is_hf_dataset(Path(path)))):
        yield from _dataset_documents(path, field, key)
        return
    files = builtin_corpus() if not path else find_files(path, key=key)
    for file in files:
        as_jsonl = format == "jsonl" or (
            format == "auto" and file.suffix.lower() in (".jsonl", ".json")
        )
        text = file.read_text(encoding="utf-8", errors="replace")
        if not as_jsonl:
            yield text
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(
                    f"{key}: {file}:{number}: expected a JSON object, found {error}"
                ) from error
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(
                    f"{key}: {file}:{number}: expected an object with a string field "
                    f"{field!r} (data.field), found keys {sorted(record)[:8] if isinstance(record, dict) else type(record).__name__}"
                )
            yield record[field]


def _dataset_documents(path: str, field: str, key: str) -> Iterator[str]:
    try:
        datasets: Any = importlib.import_module("datasets")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"{key} = {path!r} is a Hugging Face datasets directory: pip install 'hp-train[datasets]'"
        ) from error
    loaded: Any = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    if field not in loaded.column_names:
        raise ValueError(
            f"{key} = {path!r}: expected a column {field!r} (data.field), found "
            f"{loaded.column_names}"
        )
    for row in loaded:
        yield str(row[field])


class PackedSamples:
    """Documents tokenized, joined with EOS and cut into samples of ``seq_len`` (+1 for targets).

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> samples = pack(["ab", "cde"], ByteTokenizer(), seq_len=3)
        >>> len(samples), samples.sample(0)[2].tolist()
        (2, [0, 0, 0])
    """

    def __init__(self, stream: torch.Tensor, document: torch.Tensor, seq_len: int) -> None:
        self.stream, self.document, self.seq_len = stream, document, seq_len

    def __len__(self) -> int:
        return max(0, (self.stream.numel() - 1) // self.seq_len)

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, targets, document_ids)`` of sample ``index``, each ``(seq_len,)``."""
        start = index * self.seq_len
        window = self.stream[start : start + self.seq_len + 1]
        documents = self.document[start : start + self.seq_len]
        return window[:-1], window[1:], documents - documents[0]

    def subset(self, first: int, last: int) -> PackedSamples:
        """Samples ``first`` to ``last - 1`` as their own set."""
        start, stop = first * self.seq_len, last * self.seq_len + 1
        return PackedSamples(self.stream[start:stop], self.document[start:stop], self.seq_len)

    def batch(self, indices: list[int]) -> Batch:
        """The samples ``indices`` stacked as one :class:`Batch`."""
        tokens, targets, documents = zip(*(self.sample(i) for i in indices), strict=True)
        return Batch(torch.stack(tokens), torch.stack(targets), torch.stack(documents))


def pack(
    documents: Iterator[str] | list[str], tokenizer: Tokenizer, *, seq_len: int
) -> PackedSamples:
    """Tokenize ``documents``, end each with EOS, and pack them into samples of ``seq_len``.

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> pack(["hello"], ByteTokenizer(), seq_len=2).sample(0)[0].tolist()
        [104, 101]
    """
    pieces, owners = [], []
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.long)
    for number, text in enumerate(documents):
        ids = torch.cat([tokenizer.encode(text), eos])
        pieces.append(ids)
        owners.append(torch.full_like(ids, number))
    if not pieces:
        return PackedSamples(
            torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), seq_len
        )
    return PackedSamples(torch.cat(pieces), torch.cat(owners), seq_len)


class BatchSampler:
    """This data-parallel rank's microbatches of each step, from seeded permutations of the samples.

    Global batch ``g`` holds the samples at positions ``g*G .. g*G+G-1`` of the endless
    sequence "permutation of epoch 0, then of epoch 1, ..." (permutation ``e`` seeded by
    ``(seed, e)``), so every sample of an epoch is read once. Rank ``r`` of ``dp`` takes
    rows ``r*G/dp .. (r+1)*G/dp - 1``, in ``accumulation`` microbatches of ``local_batch``.
    ``position`` (samples consumed, all ranks together) is the whole state.

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> samples = pack(["x" * 40], ByteTokenizer(), seq_len=4)
        >>> sampler = BatchSampler(samples, seed=0, dp_rank=0, dp=1, local_batch=2, accumulation=1)
        >>> [b.tokens.shape for b in sampler.next_step()]
        [torch.Size([2, 4])]
    """

    def __init__(
        self,
        samples: PackedSamples,
        *,
        seed: int,
        dp_rank: int,
        dp: int,
        local_batch: int,
        accumulation: int,
        shuffle: bool = True,
    ) -> None:
        if len(samples) == 0:
            raise ValueError(
                f"expected at least one sample of seq_len {samples.seq_len} + 1 tokens, found "
                f"{samples.stream.numel()} tokens (more text, or a shorter training.seq_len)"
            )
        self.samples, self.seed, self.shuffle = samples, seed, shuffle
        self.dp_rank, self.dp = dp_rank, dp
        self.local_batch, self.accumulation = local_batch, accumulation
        self.global_batch = dp * local_batch * accumulation
        self.position = 0
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            n = len(self.samples)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(n, generator=generator)
            else:
                order = torch.arange(n)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def indices(self, position: int, count: int) -> list[int]:
        """The sample indices at positions ``position .. position + count - 1``."""
        n = len(self.samples)
        return [int(self._order(p // n)[p % n]) for p in range(position, position + count)]

    def next_step(self) -> list[Batch]:
        """This rank's microbatches of the next global batch (advances ``position``)."""
        per_rank = self.local_batch * self.accumulation
        mine = self.indices(self.position + self.dp_rank * per_rank, per_rank)
        self.position += self.global_batch
        return [
            self.samples.batch(mine[i : i + self.local_batch])
            for i in range(0, per_rank, self.local_batch)
        ]

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional)."""
        return self.position / len(self.samples)

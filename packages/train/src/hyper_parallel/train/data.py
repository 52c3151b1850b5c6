"""Data: documents from text, JSONL or ``datasets`` directories, packed with document ids, sharded.

Documents are tokenized, each followed by EOS, joined into one stream and cut into
samples of ``seq_len`` tokens (targets: the next ``seq_len``). A sample keeps its
``document_ids`` (0, 1, ... in the order its documents start) so that attention can stay
inside documents. :class:`BatchSampler` walks seeded permutations of the samples, epoch
after epoch; each data-parallel rank takes its own rows of every global batch, and its
position (samples consumed) is all it needs to continue exactly after a resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from hyper_parallel.train.documents import builtin_corpus, find_files, read_documents
from hyper_parallel.train.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "BatchSampler",
    "GlobalBatchWalk",
    "InMemoryTokens",
    "PackedSamples",
    "Prefetcher",
    "TokenSource",
    "builtin_corpus",
    "find_files",
    "pack",
    "read_documents",
]


@dataclass(frozen=True)
class Batch:
    """One microbatch of one rank: ``tokens``, ``targets`` and ``document_ids``, ``(batch, seq)``."""

    tokens: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        return Batch(self.tokens.to(device), self.targets.to(device), self.document_ids.to(device))


class TokenSource(Protocol):
    """A token stream with its documents: in memory (:func:`pack`) or memory-mapped shards."""

    def __len__(self) -> int:
        """The number of tokens."""
        ...

    def window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``start .. stop - 1`` and the number of the document each belongs to (int64)."""
        ...


class InMemoryTokens:
    """A token stream and each token's document number, as two int64 tensors."""

    def __init__(self, stream: torch.Tensor, document: torch.Tensor) -> None:
        self.stream, self.document = stream, document

    def __len__(self) -> int:
        return self.stream.numel()

    def window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream[start:stop], self.document[start:stop]


class PackedSamples:
    """A token stream cut into samples of ``seq_len`` (+1 for targets): tokens ``start .. stop - 1``.

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> samples = pack(["ab", "cde"], ByteTokenizer(), seq_len=3)
        >>> len(samples), samples.sample(0)[2].tolist()
        (2, [0, 0, 0])
    """

    def __init__(
        self, source: TokenSource, seq_len: int, *, start: int = 0, stop: int | None = None
    ) -> None:
        self.source, self.seq_len = source, seq_len
        self.start = start
        self.stop = len(source) if stop is None else min(stop, len(source))

    @property
    def tokens(self) -> int:
        """The number of tokens the samples are cut from."""
        return max(0, self.stop - self.start)

    @property
    def stream(self) -> torch.Tensor:
        """All the tokens (reads them all: for small sets and tests)."""
        return self.source.window(self.start, self.stop)[0]

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.seq_len)

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, targets, document_ids)`` of sample ``index``, each ``(seq_len,)``."""
        start = self.start + index * self.seq_len
        window, documents = self.source.window(start, start + self.seq_len + 1)
        documents = documents[: self.seq_len]
        return window[:-1], window[1:], documents - documents[0]

    def subset(self, first: int, last: int) -> PackedSamples:
        """Samples ``first`` to ``last - 1`` as their own set."""
        start = self.start + first * self.seq_len
        stop = self.start + last * self.seq_len + 1
        return PackedSamples(self.source, self.seq_len, start=start, stop=min(stop, self.stop))

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
        empty = torch.empty(0, dtype=torch.long)
        return PackedSamples(InMemoryTokens(empty, empty), seq_len)
    return PackedSamples(InMemoryTokens(torch.cat(pieces), torch.cat(owners)), seq_len)


class GlobalBatchWalk:
    """The walk of global batches both samplers share (:class:`BatchSampler`, a mixture's).

    Global batch ``g`` holds the positions ``g*G .. g*G+G-1``; rank ``r`` of ``dp`` takes
    positions ``r*G/dp .. (r+1)*G/dp - 1``, in ``accumulation`` microbatches of
    ``local_batch``. ``position`` (samples consumed, all ranks together) is the whole state;
    a subclass says which sample stands at a position (:meth:`rows`).
    """

    def __init__(self, *, dp_rank: int, dp: int, local_batch: int, accumulation: int) -> None:
        self.dp_rank, self.dp = dp_rank, dp
        self.local_batch, self.accumulation = local_batch, accumulation
        self.global_batch = dp * local_batch * accumulation
        self.position = 0

    def rows(self, position: int, count: int) -> Batch:
        """The samples at positions ``position .. position + count - 1`` as one batch."""
        raise NotImplementedError

    def step_batches(self, position: int) -> list[Batch]:
        """This rank's microbatches of the global batch that starts at ``position``."""
        per_rank = self.local_batch * self.accumulation
        first = position + self.dp_rank * per_rank
        return [
            self.rows(first + i, self.local_batch) for i in range(0, per_rank, self.local_batch)
        ]

    def next_step(self) -> list[Batch]:
        """This rank's microbatches of the next global batch (advances ``position``)."""
        batches = self.step_batches(self.position)
        self.position += self.global_batch
        return batches


class BatchSampler(GlobalBatchWalk):
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
                f"{samples.tokens} tokens (more text, or a shorter training.seq_len)"
            )
        super().__init__(dp_rank=dp_rank, dp=dp, local_batch=local_batch, accumulation=accumulation)
        self.samples, self.seed, self.shuffle = samples, seed, shuffle
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

    def rows(self, position: int, count: int) -> Batch:
        """The samples at positions ``position .. position + count - 1`` as one batch."""
        return self.samples.batch(self.indices(position, count))

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional)."""
        return self.position / len(self.samples)


class Sampler(Protocol):
    """What the training loop reads batches from (:class:`BatchSampler`, a mixture's sampler)."""

    position: int
    global_batch: int

    def step_batches(self, position: int) -> list[Batch]:
        """This rank's microbatches of the global batch that starts at ``position``."""
        ...

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional)."""
        ...


class Prefetcher:
    """A sampler whose next step's batches are read in a background thread while a step runs.

    ``position`` is the samples consumed (what a checkpoint saves), never the prefetched
    ones: setting it (a resume) drops a prefetch made for another position.

    Example::

        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> samples = pack(["x" * 40], ByteTokenizer(), seq_len=4)
        >>> loader = Prefetcher(BatchSampler(samples, seed=0, dp_rank=0, dp=1, local_batch=2,
        ...                                  accumulation=1))
        >>> [b.tokens.shape for b in loader.next_step()], loader.position
        ([torch.Size([2, 4])], 2)
        >>> loader.close()
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-train-data")
        self._ahead: tuple[int, Future[list[Batch]]] | None = None

    @property
    def position(self) -> int:
        """Samples consumed, all ranks together."""
        return self.sampler.position

    @position.setter
    def position(self, value: int) -> None:
        self.sampler.position = value

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional)."""
        return self.sampler.epoch

    def next_step(self) -> list[Batch]:
        """This rank's microbatches of the next global batch; starts reading the one after."""
        position = self.sampler.position
        if self._ahead is not None and self._ahead[0] == position:
            batches = self._ahead[1].result()
        else:
            batches = self.sampler.step_batches(position)
        following = position + self.sampler.global_batch
        self._ahead = (following, self._pool.submit(self.sampler.step_batches, following))
        self.sampler.position = following
        return batches

    def close(self) -> None:
        """Stop the background thread (a prefetch in flight finishes first)."""
        self._pool.shutdown(wait=True)

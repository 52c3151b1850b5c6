"""A seeded mixture of sample sets (``data.mix``): each sample drawn from one source by weight.

Positions are cut into blocks of :data:`BLOCK` samples. Each block holds each source's
share of the weights (rounded so that the counts fill the block), in an order seeded by
``(seed, block)``; source ``s``'s ``k``-th draw is sample ``k`` of its own endless
sequence of seeded permutations, as :class:`~.data.BatchSampler` walks one set. So the
sample at any position is a function of the position alone: the position is the whole
state, a checkpoint saves it, and a resume continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyper_parallel.train.data import Batch, GlobalBatchWalk, PackedSamples

__all__ = ["BLOCK", "Mixture", "MixtureSampler", "block_counts"]

#: Samples per block: within a block the sources' counts match the weights to 1/BLOCK.
BLOCK = 1000


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Each source's samples in a block: ``block x weight`` rounded by largest remainder.

    Example::

        >>> block_counts([0.7, 0.3]), block_counts([1, 1, 1])
        ([700, 300], [334, 333, 333])
    """
    total = sum(weights)
    exact = [block * w / total for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass(frozen=True)
class Mixture:
    """Sample sets and their weights (the validation sets of a mixture are its sources' tails)."""

    sources: tuple[PackedSamples, ...]
    weights: tuple[float, ...]
    names: tuple[str, ...]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def seq_len(self) -> int:
        """The sources' sample length."""
        return self.sources[0].seq_len


class MixtureSampler(GlobalBatchWalk):
    """This data-parallel rank's microbatches of each step, drawn from a :class:`Mixture`.

    Global batches and ranks' rows as :class:`~.data.BatchSampler`; ``position`` is the
    whole state. ``shuffle = False`` (validation) walks each source in order; the sources
    stay interleaved by the seeded blocks.

    Example::

        >>> from hyper_parallel.train.data import pack
        >>> from hyper_parallel.train.tokenizer import ByteTokenizer
        >>> a, b = (pack([c * 400], ByteTokenizer(), seq_len=4) for c in "ab")
        >>> sampler = MixtureSampler(Mixture((a, b), (0.75, 0.25), ("a", "b")), seed=0,
        ...                          dp_rank=0, dp=1, local_batch=1000, accumulation=1)
        >>> (sampler.next_step()[0].tokens[:, 0] == ord("a")).sum().item()
        750
    """

    def __init__(
        self,
        mixture: Mixture,
        *,
        seed: int,
        dp_rank: int,
        dp: int,
        local_batch: int,
        accumulation: int,
        shuffle: bool = True,
    ) -> None:
        for name, source in zip(mixture.names, mixture.sources, strict=True):
            if len(source) == 0:
                raise ValueError(
                    f"data.mix: {name}: expected at least one sample of seq_len "
                    f"{source.seq_len} + 1 tokens, found {source.tokens} tokens"
                )
        super().__init__(dp_rank=dp_rank, dp=dp, local_batch=local_batch, accumulation=accumulation)
        self.mixture, self.seed, self.shuffle = mixture, seed, shuffle
        self.counts = block_counts(list(mixture.weights))
        self._block: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._orders: dict[tuple[int, int], torch.Tensor] = {}

    def _blocks(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``block``'s source of each slot, and each slot's draw number within the block."""
        if self._block is None or self._block[0] != block:
            slots = torch.repeat_interleave(
                torch.arange(len(self.counts)), torch.tensor(self.counts)
            )
            # interleaved even without shuffle (validation): every source in every batch
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            slots = slots[torch.randperm(BLOCK, generator=generator)]
            one_hot = torch.nn.functional.one_hot(slots, len(self.counts))
            before = (one_hot.cumsum(0) - one_hot).gather(1, slots[:, None])[:, 0]
            self._block = (block, slots, before)
        return self._block[1], self._block[2]

    def _order(self, source: int, epoch: int) -> torch.Tensor:
        key = (source, epoch)
        if key not in self._orders:
            n = len(self.mixture.sources[source])
            if self.shuffle:
                seed = (self.seed * 1_000_003 + epoch) * 1_009 + source + 1
                order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            else:
                order = torch.arange(n)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source}
            self._orders[key] = order
        return self._orders[key]

    def draws(self, position: int, count: int) -> list[tuple[int, int]]:
        """``(source, sample index)`` at positions ``position .. position + count - 1``."""
        found = []
        for p in range(position, position + count):
            block, slot = divmod(p, BLOCK)
            slots, before = self._blocks(block)
            source = int(slots[slot])
            k = block * self.counts[source] + int(before[slot])
            n = len(self.mixture.sources[source])
            found.append((source, int(self._order(source, k // n)[k % n])))
        return found

    def rows(self, position: int, count: int) -> Batch:
        """The samples at positions ``position .. position + count - 1`` as one batch."""
        samples = [self.mixture.sources[s].sample(i) for s, i in self.draws(position, count)]
        tokens, targets, documents = zip(*samples, strict=True)
        return Batch(torch.stack(tokens), torch.stack(targets), torch.stack(documents))

    @property
    def epoch(self) -> float:
        """Samples consumed over the sources' samples together (fractional)."""
        return self.position / len(self.mixture)

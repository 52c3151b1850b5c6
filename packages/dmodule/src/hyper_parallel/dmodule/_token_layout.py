"""Where each token sits under context parallelism: head-tail order, documents, ``TokenLayout``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.dtensor import DeviceMesh

#: The attention algorithms of context parallelism (``Attention.Config.context_parallel``).
CP_ALGORITHMS = ("allgather", "ring", "alltoall")
#: The mesh axis the sequence is split over.
CP_AXIS = "cp"


def head_tail_index(
    seq: int, cp: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions cp rank ``rank`` holds: chunks ``rank`` and ``2*cp-1-rank`` of ``2*cp``.

    Example::

        >>> head_tail_index(12, cp=3, rank=1).tolist()
        [2, 3, 8, 9]
    """
    if seq % (2 * cp):
        raise ValueError(
            f"context parallel: expected the sequence length to divide into 2 * cp = {2 * cp} "
            f"equal chunks (head-tail load balancing over mesh axis 'cp' of size {cp}), "
            f"found seq = {seq}"
        )
    chunk = seq // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def head_tail_order(seq: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of every rank's tokens, rank after rank (an all-gather's order).

    Example::

        >>> head_tail_order(8, cp=2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return torch.cat([head_tail_index(seq, cp, r, device) for r in range(cp)])


def check_document_ids(
    document_ids: torch.Tensor, tokens: torch.Tensor | tuple[int, int], *, where: str
) -> None:
    """Raise a ``ValueError`` unless ``document_ids`` is an int ``[batch, seq]`` like ``tokens``,
    starting at 0 and non-decreasing along each row.

    ``tokens`` is the token tensor, or its ``(batch, seq)``.

    Example::

        >>> check_document_ids(torch.tensor([[0, 1, 0]]), torch.zeros(1, 3), where="Llama")
        Traceback (most recent call last):
        ...
        ValueError: Llama: expected document_ids non-decreasing along the sequence, found a decrease in row 0 at position 2 (1 -> 0)
    """
    if (
        not isinstance(document_ids, torch.Tensor)
        or document_ids.is_floating_point()
        or document_ids.is_complex()
        or document_ids.dtype == torch.bool  # passes is_floating_point, fails subtraction
    ):
        raise ValueError(
            f"{where}: expected document_ids as an integer tensor (e.g. torch.int64), found "
            f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}"
        )
    shape = list(tokens.shape[:2] if isinstance(tokens, torch.Tensor) else tokens)
    if list(document_ids.shape) != shape or document_ids.ndim != 2:
        raise ValueError(
            f"{where}: expected document_ids of shape [batch, seq] = {shape} "
            f"(the tokens' shape), found {list(document_ids.shape)}"
        )
    if document_ids.numel() == 0:
        return
    first = document_ids[:, 0]
    if bool((first != 0).any()):
        row = int((first != 0).nonzero()[0, 0])
        raise ValueError(
            f"{where}: expected document_ids to start at 0 in every row, found "
            f"{int(first[row])} in row {row}"
        )
    steps = document_ids[:, 1:] - document_ids[:, :-1]
    if bool((steps < 0).any()):
        row, col = (int(i) for i in (steps < 0).nonzero()[0])
        raise ValueError(
            f"{where}: expected document_ids non-decreasing along the sequence, found a "
            f"decrease in row {row} at position {col + 1} "
            f"({int(document_ids[row, col])} -> {int(document_ids[row, col + 1])})"
        )


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (0 at every document's first token).

    Example::

        >>> document_positions(torch.tensor([[0, 1, 1, 2]])).tolist()
        [[0, 0, 1, 0]]
    """
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=-1).values


#: Chunks per cp rank that :func:`balanced_assignment` deals out (``2 * BALANCE_PIECES``).
BALANCE_PIECES = 4


def attention_work(document_ids: torch.Tensor) -> torch.Tensor:
    """Each position's causal attention work summed over the rows: its place in its document + 1.

    Example::

        >>> attention_work(torch.tensor([[0, 0, 1], [0, 0, 0]])).tolist()
        [2, 4, 4]
    """
    return (document_positions(document_ids) + 1).sum(0)


def balanced_assignment(
    document_ids: torch.Tensor, cp: int
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Every cp rank's positions for a packed batch, and the chunk size: equal tokens, even work.

    The sequence is cut into ``2 * BALANCE_PIECES * cp`` equal chunks (or ``2 * cp`` if it
    does not divide); chunks are dealt heaviest first to the rank with the least work that
    still has room (each rank gets the same number). The head-tail order is kept when it
    is at least as even. Every rank computes the same result from the same ids.

    Example::

        >>> ranks, chunk = balanced_assignment(torch.zeros(1, 8, dtype=torch.long), cp=2)
        >>> [r.tolist() for r in ranks], chunk   # one document: head-tail is already even
        ([[0, 1, 6, 7], [2, 3, 4, 5]], 2)
    """
    seq = document_ids.shape[-1]
    device = document_ids.device
    work = attention_work(document_ids)
    head_tail = tuple(head_tail_index(seq, cp, r, device) for r in range(cp))
    ht_chunk = seq // (2 * cp)
    n_chunks = 2 * BALANCE_PIECES * cp
    if seq % n_chunks:
        return head_tail, ht_chunk
    chunk = seq // n_chunks
    chunk_work = work.view(n_chunks, chunk).sum(1).tolist()
    per_rank = n_chunks // cp
    loads, owned = [0] * cp, [[] for _ in range(cp)]  # type: list[int], list[list[int]]
    for c in sorted(range(n_chunks), key=lambda i: (-chunk_work[i], i)):
        rank = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(c)
        loads[rank] += chunk_work[c]
    head_tail_max = max(int(work[i].sum()) for i in head_tail)
    if max(loads) >= head_tail_max:
        return head_tail, ht_chunk
    ranks = tuple(
        torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in sorted(cs)])
        for cs in owned
    )
    return ranks, chunk


@dataclass(frozen=True)
class ContextParallel:
    """The ``cp`` axis a parallelized model splits its sequence over, and the algorithm.

    ``mesh`` is one-dimensional with axis ``"cp"``.

    Example::

        cp = ContextParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), "ring")
        cp.size, cp.rank   # (2, 0) on rank 0
    """

    mesh: DeviceMesh
    algorithm: str = "allgather"

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallel:
        return self  # immutable; its mesh holds process groups, which cannot be copied

    @property
    def size(self) -> int:
        """Ranks along ``cp``."""
        return self.mesh.size()

    @property
    def rank(self) -> int:
        """This rank's coordinate along ``cp``."""
        return self.mesh.get_local_rank(CP_AXIS)

    def local_index(self, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of this rank's tokens (:func:`head_tail_index`)."""
        return head_tail_index(seq, self.size, self.rank, device)


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens an attention layer sees sit: what masks and RoPE are built from.

    ``positions``: ``[batch or 1, seq_local]`` RoPE positions (absolute, or restarting per
    document); ``index``: ``[seq_local]`` each local token's place in the full sequence;
    ``document_ids``: ``[batch, seq_full]`` over the *full* sequence in its original order
    (``None``: one document per row); ``cp``: the context-parallel axis (``None``: the
    whole sequence is local).

    Example::

        >>> layout = TokenLayout.build(4)
        >>> layout.positions.tolist(), layout.index.tolist()
        ([[0, 1, 2, 3]], [0, 1, 2, 3])
    """

    positions: torch.Tensor
    index: torch.Tensor
    seq: int
    document_ids: torch.Tensor | None = None
    cp: ContextParallel | None = None
    #: every cp rank's global positions (``None``: head-tail order), each made of equal chunks
    assignment: tuple[torch.Tensor, ...] | None = None
    chunk: int = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenLayout:
        return self

    def rank_index(self, rank: int) -> torch.Tensor:
        """The global positions cp rank ``rank`` holds (:func:`head_tail_index` unless balanced)."""
        if self.assignment is not None:
            return self.assignment[rank]
        assert self.cp is not None
        return head_tail_index(self.seq, self.cp.size, rank, self.index.device)

    def order(self) -> torch.Tensor:
        """Every cp rank's positions, rank after rank (the order of an all-gather over cp)."""
        assert self.cp is not None
        return torch.cat([self.rank_index(r) for r in range(self.cp.size)])

    def pieces(self, index: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
        """``index`` cut into its contiguous chunks: ``(slice into index, positions)`` each."""
        chunk = self.chunk or index.shape[0] // 2
        return [
            (slice(start, start + chunk), index[start : start + chunk])
            for start in range(0, index.shape[0], chunk)
        ]

    @classmethod
    def build(
        cls,
        seq: int,
        *,
        document_ids: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
        device: torch.device | str | None = None,
    ) -> TokenLayout:
        """The layout of a full sequence of ``seq`` tokens, split over ``cp`` when given.

        Example::

            >>> TokenLayout.build(4, document_ids=torch.tensor([[0, 0, 1, 1]])).positions.tolist()
            [[0, 1, 0, 1]]
        """
        if document_ids is not None:
            device = document_ids.device
        split = cp is not None and cp.size > 1
        assignment, chunk = None, 0
        if cp is not None and split:
            index = cp.local_index(seq, device)  # checks seq divides into 2 * cp chunks
            chunk = seq // (2 * cp.size)
            if document_ids is not None:
                assignment, chunk = balanced_assignment(document_ids, cp.size)
                index = assignment[cp.rank]
        else:
            index = torch.arange(seq, device=device)
        if document_ids is None:
            positions = index.unsqueeze(0)
        else:
            positions = document_positions(document_ids)[:, index]
        return cls(positions, index, seq, document_ids, cp if split else None, assignment, chunk)

    def local_documents(self) -> torch.Tensor | None:
        """The document ids of the local tokens (``[batch, seq_local]``)."""
        return None if self.document_ids is None else self.document_ids[:, self.index]

    def mask(self, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
        """``[batch or 1, 1, q, kv]`` True where a query at ``q_index`` may see a key at ``kv_index``."""
        allowed = kv_index.unsqueeze(0) <= q_index.unsqueeze(1)
        if self.document_ids is None:
            return allowed[None, None]
        docs = self.document_ids
        same = docs[:, q_index].unsqueeze(2) == docs[:, kv_index].unsqueeze(1)
        return (allowed.unsqueeze(0) & same).unsqueeze(1)

"""Context parallelism: the sequence split over mesh axis ``cp``, and packed documents.

A batch arrives with the full sequence on every ``cp`` rank. At the embedding each rank
keeps its own tokens in *head-tail* order: the sequence is cut into ``2 * cp`` equal
chunks and cp rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (so under a causal
mask every rank does the same attention work). Everything per token then runs on the
local ``seq / cp`` tokens; only attention meets the other ranks' keys and values, by
one of three algorithms (:data:`CP_ALGORITHMS`):

- ``"allgather"``: keys and values all-gathered over ``cp`` (their gradients
  reduce-scattered); the mask is built from each token's global position.
- ``"ring"``: key/value blocks passed around the ring with point-to-point sends (the
  next transfer issued before the current block is computed), partial results merged
  by their log-sum-exp; sub-blocks that the mask hides entirely are skipped.
- ``"alltoall"`` (Ulysses): an all-to-all trades sequence shards for head shards before
  attention and back after (the local key/value heads must divide by ``cp``).

Packed documents (``document_ids``: ``[batch, seq]`` ints from 0, non-decreasing along the
sequence) are masked so that no token attends across a boundary, and their RoPE positions
restart at 0 in each document, with and without ``cp`` and with every algorithm. Under
``cp`` a packed batch is split by :func:`balanced_assignment` (equal tokens per rank,
even attention work) instead of head-tail.

Example::

    >>> head_tail_index(8, cp=2, rank=0).tolist()   # chunks 0 and 3 of 4
    [0, 1, 6, 7]
    >>> document_positions(torch.tensor([[0, 0, 1, 1, 1]])).tolist()
    [[0, 1, 0, 1, 2]]
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hyper_parallel.dtensor import DeviceMesh, DTensor, collectives

__all__ = [
    "CP_ALGORITHMS",
    "CP_AXIS",
    "ContextParallel",
    "TokenLayout",
    "attend",
    "attention_work",
    "balanced_assignment",
    "check_document_ids",
    "check_inputs",
    "check_same_over_cp",
    "document_positions",
    "gather_sequence",
    "head_tail_index",
    "head_tail_order",
    "reduce_loss",
]

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


_checking: ContextVar[bool | None] = ContextVar("hp_cp_check_inputs", default=None)


@contextmanager
def check_inputs(enabled: bool = True) -> Iterator[None]:
    """Debug mode: check that every cp rank of a group got the same batch (one small all-gather).

    Outside any ``check_inputs`` block, the environment variable
    ``HYPER_PARALLEL_CP_CHECK=1`` turns the check on.

    Example::

        with check_inputs():
            model.loss(tokens, targets)   # ValueError if the cp ranks' tokens differ
    """
    token = _checking.set(enabled)
    try:
        yield
    finally:
        _checking.reset(token)


def _check_enabled() -> bool:
    enabled = _checking.get()
    if enabled is None:
        return os.environ.get("HYPER_PARALLEL_CP_CHECK", "") not in ("", "0")
    return enabled


def check_same_over_cp(cp: ContextParallel, where: str, **tensors: torch.Tensor | None) -> None:
    """In the debug mode of :func:`check_inputs`, raise on every cp rank if ``tensors`` differ across cp.

    Compares a fingerprint per tensor (a position-weighted sum), not the tensors.

    Example::

        check_same_over_cp(cp, "Llama.loss", tokens=tokens, targets=targets)
    """
    if not _check_enabled():
        return
    names = [name for name, t in tensors.items() if t is not None]
    prints = []
    for name in names:
        t = tensors[name]
        assert t is not None
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        prints.append(torch.stack([(flat * weights).sum(), flat.sum()]))
    if not prints:
        return
    gathered = collectives.all_gather(torch.stack(prints), cp.mesh, CP_AXIS)
    for i, name in enumerate(names):
        differ = [r for r in range(cp.size) if not torch.equal(gathered[r, i], gathered[0, i])]
        if differ:
            raise ValueError(
                f"{where}: expected the same {name} on every rank of mesh axis 'cp' (the full "
                f"sequence of the group's batch), found cp ranks {differ} differing from cp "
                "rank 0"
            )


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


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, kv, s, d)`` → ``(b, kv * n_rep, s, d)``, each key/value head serving ``n_rep`` queries."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x.unsqueeze(2).expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout | None
) -> torch.Tensor:
    """Masked attention of local ``q`` ``(b, h, s, d)`` over ``k, v`` ``(b, kv_h, s, d)``.

    Causal over the full sequence, never across a document; over ``layout.cp`` by its
    algorithm. The result has ``q``'s shape.

    Example::

        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> attend(q, k, v, None).shape
        torch.Size([1, 2, 4, 8])
    """
    if layout is None or (layout.cp is None and layout.document_ids is None):
        return _sdpa(q, k, v, None)
    cp = layout.cp
    if cp is None:
        return _sdpa(q, k, v, layout.mask(layout.index, layout.index))
    if cp.algorithm == "allgather":
        order = layout.order()
        k_all = _GatherSequence.apply(k, cp, 2)
        v_all = _GatherSequence.apply(v, cp, 2)
        return _sdpa(q, k_all, v_all, layout.mask(layout.index, order))
    if cp.algorithm == "alltoall":
        if k.shape[1] % cp.size:
            raise ValueError(
                f"Attention: context_parallel='alltoall' needs the local key/value heads "
                f"({k.shape[1]}) to divide by the size of mesh axis 'cp' ({cp.size})"
            )
        order = layout.order()
        q_h, k_h, v_h = (_SeqToHeads.apply(t, cp) for t in (q, k, v))
        out = _sdpa(q_h, k_h, v_h, layout.mask(order, order))
        return _HeadsToSeq.apply(out, cp)  # type: ignore[no-any-return]
    if cp.algorithm == "ring":
        return ring_attention(q, k, v, layout)
    raise ValueError(
        f"Attention: context_parallel must be one of {CP_ALGORITHMS}, found {cp.algorithm!r}"
    )


# -- differentiable exchanges over cp -----------------------------------------------------------
def _gather(x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
    stacked = collectives.all_gather(x.contiguous(), cp.mesh, CP_AXIS)
    return torch.cat(stacked.unbind(0), dim=dim)


def _scatter_sum(grad: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
    stacked = torch.stack(grad.chunk(cp.size, dim=dim)).contiguous()
    return collectives.reduce_scatter(stacked, cp.mesh, CP_AXIS, "sum")


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over cp (rank order); backward: reduce-scatter the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        return _gather(x, cp, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scatter_sum(grad, ctx.cp, ctx.dim), None, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather along ``dim`` over cp of an output every rank then uses alike (logits):
    backward keeps this rank's own slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        return _gather(x, cp, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.chunk(ctx.cp.size, dim=ctx.dim)[ctx.cp.rank].contiguous(), None, None


def _seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    # (b, h, s_local, d): head group j goes to cp rank j; the sequences come back rank by rank
    stacked = torch.stack(x.chunk(cp.size, dim=1)).contiguous()
    return torch.cat(collectives.all_to_all(stacked, cp.mesh, CP_AXIS).unbind(0), dim=2)


def _heads_to_seq(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    # (b, h/cp, s_full, d): sequence piece j goes back to cp rank j; head groups come back
    stacked = torch.stack(x.chunk(cp.size, dim=2)).contiguous()
    return torch.cat(collectives.all_to_all(stacked, cp.mesh, CP_AXIS).unbind(0), dim=1)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.cp), None


def gather_sequence(x: torch.Tensor, cp: ContextParallel, order: torch.Tensor) -> torch.Tensor:
    """Per-token outputs ``(batch, seq/cp, ...)`` of every cp rank, back in the original order.

    Used for the logits a parallelized model returns: the same full tensor on every cp
    rank; its gradient on each rank is its own tokens' slice.

    Example::

        logits = gather_sequence(local_logits, cp, layout.order())   # (batch, seq, vocab)
    """
    if isinstance(x, DTensor):
        local = gather_sequence(x.to_local(), cp, order)
        return DTensor.from_local(local, x.device_mesh, x.placements)
    gathered = _GatherReplicated.apply(x, cp, 1)
    inverse = torch.argsort(order.to(x.device))
    return gathered.index_select(1, inverse)  # type: ignore[no-any-return]


class _SumOverCp(torch.autograd.Function):
    """Forward: the sum over cp; backward: the gradient as it is (each rank's own share)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        return collectives.all_reduce(x, cp.mesh, CP_AXIS, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def reduce_loss(local_share: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The loss of the whole sequence from each cp rank's share of it, on every cp rank.

    ``local_share`` is this rank's tokens' summed loss divided by the group's token
    count; backward sends each rank's share its own gradient only, so that gradients
    summed over cp (:func:`~hyper_parallel.dmodule.models.llama.Llama.parallelize`'s
    hooks) are those of the one-process loss.

    Example::

        loss = reduce_loss(local_sum / n_tokens, cp)
    """
    return _SumOverCp.apply(local_share, cp)  # type: ignore[no-any-return]


# -- ring attention -------------------------------------------------------------------------------
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout
) -> torch.Tensor:
    """Attention with key/value blocks passed around the ``cp`` ring (see the module doc).

    Example::

        out = ring_attention(q, k, v, layout)   # layout.cp.algorithm == "ring"
    """
    return _RingAttention.apply(q, k, v, layout)  # type: ignore[no-any-return]


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # (b, h, s, d) -> (b, kv_h, rep, s, d): the query heads of each key/value head together
    b, h, s, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, s, d)


def _visible(
    layout: TokenLayout, q_index: torch.Tensor, kv_index: torch.Tensor
) -> torch.Tensor | None:
    """The mask ``[b|1, 1, 1, q, kv]`` of a sub-block, or ``None`` when it hides everything."""
    if int(q_index.max()) < int(kv_index.min()):
        return None  # causal: every key is after every query
    mask = layout.mask(q_index, kv_index)
    return mask.unsqueeze(1) if bool(mask.any()) else None


def _shift(tensor: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    return collectives.send_recv(tensor.contiguous(), cp.mesh, CP_AXIS, async_op=True)


@dataclass(frozen=True)
class _RingBlock:
    """A sub-block of a ring step that the mask does not hide entirely.

    ``q``/``kv``: slices into the local queries and the step's key/value block;
    ``mask``: ``[b|1, 1, 1, q, kv]``; ``k``/``v``: the keys and values of ``kv`` in float32,
    ``(b, kv_h, 1, kv, d)``.
    """

    q: slice
    kv: slice
    mask: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _ring_steps(layout: TokenLayout, kv: torch.Tensor) -> Iterator[list[_RingBlock]]:
    """The ring's traversal, the same for forward and backward: each step's visible blocks.

    Step ``s`` holds the keys and values (``kv``: ``[2, b, kv_h, s_local, d]``) of cp rank
    ``rank - s``; the transfer of the next step's block is issued before the step is
    handed out, so that it overlaps the caller's compute, and waited for when the caller
    asks for the next step.
    """
    cp = layout.cp
    assert cp is not None
    for step in range(cp.size):
        pending = _shift(kv, cp) if step < cp.size - 1 else None
        source = (cp.rank - step) % cp.size
        blocks = []
        for qs, q_index in layout.pieces(layout.index):
            for ks, k_index in layout.pieces(layout.rank_index(source)):
                mask = _visible(layout, q_index, k_index)
                if mask is not None:
                    k, v = (kv[i][:, :, ks].float().unsqueeze(2) for i in (0, 1))
                    blocks.append(_RingBlock(qs, ks, mask, k, v))
        yield blocks
        if pending is not None:
            kv = collectives.wait(pending)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout
    ) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = _grouped(q, k.shape[1]).float()
        b, kvh, rep, s, _ = qg.shape
        acc = torch.zeros(b, kvh, rep, s, v.shape[-1], dtype=torch.float32, device=q.device)
        row_max = torch.full((b, kvh, rep, s), -math.inf, dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(b, kvh, rep, s, dtype=torch.float32, device=q.device)
        for blocks in _ring_steps(layout, torch.stack([k, v])):
            for block in blocks:
                qs = block.q
                scores = (qg[:, :, :, qs] @ block.k.transpose(-1, -2)) * scale
                scores = scores.masked_fill(~block.mask, -math.inf)
                new_max = torch.maximum(row_max[..., qs], scores.amax(-1))
                safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                keep = torch.exp(row_max[..., qs] - safe)
                probs = torch.exp(scores - safe.unsqueeze(-1))
                row_sum[..., qs] = row_sum[..., qs] * keep + probs.sum(-1)
                acc[..., qs, :] = acc[..., qs, :] * keep.unsqueeze(-1) + probs @ block.v
                row_max[..., qs] = new_max
        out = acc / row_sum.unsqueeze(-1)
        lse = row_max + torch.log(row_sum)
        ctx.layout, ctx.scale = layout, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(b, kvh * rep, s, -1).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        layout: TokenLayout = ctx.layout
        cp = layout.cp
        assert cp is not None
        scale = ctx.scale
        kvh = k.shape[1]
        qg = _grouped(q, kvh).float()
        dout = _grouped(grad, kvh).float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qg)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for blocks in _ring_steps(layout, torch.stack([k, v])):
            for block in blocks:
                qs, ks = block.q, block.kv
                scores = (qg[:, :, :, qs] @ block.k.transpose(-1, -2)) * scale
                probs = torch.exp(scores - lse[..., qs].unsqueeze(-1)).masked_fill(~block.mask, 0.0)
                do = dout[:, :, :, qs]
                dkv[1][:, :, ks] += (probs.transpose(-1, -2) @ do).sum(2)
                dprobs = do @ block.v.transpose(-1, -2)
                dscores = probs * (dprobs - delta[..., qs].unsqueeze(-1)) * scale
                dq[:, :, :, qs] += dscores @ block.k
                dkv[0][:, :, ks] += (dscores.transpose(-1, -2) @ qg[:, :, :, qs]).sum(2)
            # the gradients travel with their block and reach its owner after cp shifts
            dkv = collectives.wait(_shift(dkv, cp))
        return (
            dq.reshape(q.shape).to(q.dtype),
            dkv[0].to(k.dtype),
            dkv[1].to(v.dtype),
            None,
        )

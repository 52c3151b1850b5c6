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

Token placement (head-tail, documents, :class:`TokenLayout`) lives in ``_token_layout``,
ring attention in ``_ring_attention``; their names are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from hyper_parallel.dmodule._ring_attention import ring_attention
from hyper_parallel.dmodule._token_layout import BALANCE_PIECES as BALANCE_PIECES
from hyper_parallel.dmodule._token_layout import (
    CP_ALGORITHMS,
    CP_AXIS,
    ContextParallel,
    TokenLayout,
    attention_work,
    balanced_assignment,
    check_document_ids,
    document_positions,
    head_tail_index,
    head_tail_order,
)
from hyper_parallel.dtensor import DTensor, collectives

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

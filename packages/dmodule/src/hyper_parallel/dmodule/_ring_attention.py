"""Ring attention over ``cp``: key/value blocks passed around the ring, merged by log-sum-exp."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.dmodule._token_layout import CP_AXIS, ContextParallel, TokenLayout
from hyper_parallel.dtensor import collectives


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

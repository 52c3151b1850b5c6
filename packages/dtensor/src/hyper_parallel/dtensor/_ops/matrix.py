"""Sharding rules of matrix products: mm, addmm, bmm, baddbmm (linear and matmul decompose to these)."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._ops.pointwise import aligned_dim
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten

_R = Replicate()
_P = Partial()


def _product_candidates(batch: bool) -> list[tuple[Placement, Placement, Placement]]:
    """``(a, b, out)`` layouts of ``a @ b`` for 2-D (or batched 3-D) operands."""
    o = 1 if batch else 0  # offset of the matrix dims
    cands: list[tuple[Placement, Placement, Placement]] = [
        (Shard(o), _R, Shard(o)),  # rows of a
        (_R, Shard(o + 1), Shard(o + 1)),  # columns of b
        (Shard(o + 1), Shard(o), _P),  # the contracted dim: partial sums
    ]
    if batch:
        cands.insert(0, (Shard(0), Shard(0), Shard(0)))
    cands += [(_R, _R, _R), (_P, _R, _P), (_R, _P, _P)]
    return cands


def _mm_rule(call: OpCall) -> Decision:
    batch = call.func.overloadpacket is aten.bmm
    cands = [((a, b), (o,)) for a, b, o in _product_candidates(batch)]

    def candidates(axis: int) -> list[Candidate]:
        return cands + _average_candidates(call, axis)

    return choose(call, candidates)


def _average_candidates(call: OpCall, axis: int) -> list[Candidate]:
    """A Partial("avg") factor times a replicated one stays Partial("avg"), as in torch."""
    out: list[Candidate] = []
    for i, spec in enumerate(call.specs[:2]):
        p = spec.placements[axis]
        if isinstance(p, Partial) and p.reduce_op == "avg":
            ins: list[Placement] = [_R, _R]
            ins[i] = p
            out.append((tuple(ins), (p,)))
    return out


def _mv_rule(call: OpCall) -> Decision:
    """``a @ v`` with a matrix and a vector: rows of ``a``, or the contracted dim (Partial)."""
    cands: list[Candidate] = [
        ((Shard(0), _R), (Shard(0),)),
        ((Shard(1), Shard(0)), (_P,)),
        ((_R, _R), (_R,)),
        ((_P, _R), (_P,)),
        ((_R, _P), (_P,)),
    ]
    return choose(call, lambda axis: cands)


def _dot_rule(call: OpCall) -> Decision:
    """``a . b`` of two vectors: shards of both give partial sums (torch's Partial)."""
    cands: list[Candidate] = [
        ((Shard(0), Shard(0)), (_P,)),
        ((_R, _R), (_R,)),
        ((_P, _R), (_P,)),
        ((_R, _P), (_P,)),
    ]
    return choose(call, lambda axis: cands)


def _addmm_rule(call: OpCall) -> Decision | None:
    """``beta * bias + alpha * (a @ b)``: the product's layouts, with the bias laid out to match.

    When the product is a Partial sum (its contracted dim is sharded) and the bias is
    replicated, only the first rank of each such mesh axis adds the bias, so the
    partial values still sum to the result.
    """
    batch = call.func.overloadpacket is aten.baddbmm
    if len(call.specs) != 3:
        return None
    bias = call.specs[0]
    out_meta = call.out_metas[0]
    assert out_meta is not None

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for a, b, o in _product_candidates(batch):
            if isinstance(o, Shard):
                j = aligned_dim(bias, out_meta.shape, o.dim)
                cands.append(((Shard(j) if j is not None else _R, a, b), (o,)))
            elif isinstance(o, Partial):
                cands.append(((o, a, b), (o,)))
                cands.append(((_R, a, b), (o,)))  # the bias added once (see above)
            else:
                cands.append(((_R, a, b), (o,)))
        return cands

    decision = choose(call, candidates)
    owner_axes = [
        axis
        for axis, (bp, op) in enumerate(
            zip(decision.inputs[0], decision.outputs[0] or (), strict=True)
        )
        if isinstance(op, Partial) and not isinstance(bp, Partial)
    ]
    if owner_axes:
        coordinate = call.mesh.get_coordinate() or [0] * call.mesh.ndim
        if any(coordinate[a] != 0 for a in owner_axes):
            decision.local_fn = _product_without_bias(batch)
    return decision


def _product_without_bias(batch: bool) -> Any:
    """``alpha * (a @ b)``: addmm/baddbmm on a rank that must not add the bias."""
    product = torch.bmm if batch else torch.mm

    def local(
        bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
    ) -> torch.Tensor:
        out = product(a, b)
        return out if alpha == 1 else out * alpha

    return local


register_rule(aten.mm.default, aten.bmm.default)(_mm_rule)
register_rule(aten.mv.default)(_mv_rule)
register_rule(aten.dot.default, aten.vdot.default)(_dot_rule)
register_rule(aten.addmm.default, aten.baddbmm.default)(_addmm_rule)

"""Sharding rules of matrix products: mm, addmm, bmm, baddbmm (linear and matmul decompose to these)."""

from __future__ import annotations

import torch

from hyper_parallel.dtensor._dispatch import Decision, OpCall, register_rule
from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._ops.pointwise import aligned_dim
from hyper_parallel.dtensor._spec import DTensorSpec
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
    return choose(call, lambda axis: cands)


def _bias_placement(bias: DTensorSpec, out_shape: tuple[int, ...], out: Placement) -> Placement | None:
    """The bias layout that adds onto an output laid out as ``out`` (None: impossible)."""
    if isinstance(out, Shard):
        j = aligned_dim(bias, out_shape, out.dim)
        return Shard(j) if j is not None else _R
    if isinstance(out, Partial):
        return out  # the bias must itself be partial, or it would be added once per rank
    return _R


def _addmm_rule(call: OpCall) -> Decision:
    batch = call.func.overloadpacket is aten.baddbmm
    bias = call.specs[0]
    if len(call.specs) != 3:
        return None  # type: ignore[return-value]
    out_meta = call.out_metas[0]
    assert out_meta is not None
    cands: list[Candidate] = []
    for a, b, o in _product_candidates(batch):
        bp = _bias_placement(bias, out_meta.shape, o)
        if bp is not None:
            cands.append(((bp, a, b), (o,)))
    return choose(call, lambda axis: cands)


register_rule(aten.mm.default, aten.bmm.default)(_mm_rule)
register_rule(aten.addmm.default, aten.baddbmm.default)(_addmm_rule)

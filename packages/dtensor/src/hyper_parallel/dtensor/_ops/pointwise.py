"""Sharding rules of element-wise ops (any op tagged ``pointwise``, with broadcasting)."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._ops._strategy import Candidate, add_once_into_partial, choose
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule, register_tag_rule
from hyper_parallel.dtensor._spec import DTensorSpec
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten

# Ops f with f(a + b) = f(a) + f(b): a Partial(sum/avg) input stays Partial.
_LINEAR_UNARY = {
    aten.neg,
    aten.neg_,
    aten.clone,
    aten.detach,
    aten.alias,
    aten._to_copy,
    aten.positive,
    aten.view_as_real,
    aten.view_as_complex,
    aten.conj_physical,
    aten.real,
    aten.imag,
}
# Sums of all-Partial inputs stay Partial.
_LINEAR_SUM = {aten.add, aten.add_, aten.sub, aten.sub_}
# Products with exactly one Partial factor (the first, for division) stay Partial.
_LINEAR_PRODUCT = {aten.mul, aten.mul_, aten.div, aten.div_}
_SCALAR_SCALE = {aten.mul, aten.mul_, aten.div, aten.div_}
# Element-wise maximum/minimum: Partial("max")/Partial("min") inputs stay Partial.
_EXTREMES = {"max": (aten.maximum, aten.fmax), "min": (aten.minimum, aten.fmin)}
# Ops that overwrite their target without reading it.
_OVERWRITES = {aten.fill_, aten.zero_}


def aligned_dim(spec: DTensorSpec, out_shape: tuple[int, ...], out_dim: int) -> int | None:
    """The dim of ``spec`` that broadcasts onto output dim ``out_dim`` (None: absent or size 1)."""
    j = out_dim - (len(out_shape) - spec.ndim)
    if j < 0 or spec.shape[j] != out_shape[out_dim]:
        return None
    return j


def _has_scalar_addend(call: OpCall) -> bool:
    """True when a non-DTensor number or 0-dim tensor takes part in an add/sub."""
    return any(not isinstance(a, DTensorSpec) for a in call.args[:2])


def pointwise_candidates(call: OpCall, axis: int) -> list[Candidate]:
    """Shard along any output dim, replicate, and keep Partial where the op is linear."""
    out_meta = call.out_metas[0]
    assert out_meta is not None
    out_shape = out_meta.shape
    n_out = len(call.out_metas)
    specs = call.specs
    cands: list[Candidate] = []
    for d in range(len(out_shape)):
        ins: list[Placement] = []
        for s in specs:
            j = aligned_dim(s, out_shape, d)
            ins.append(Shard(j) if j is not None else Replicate())
        cands.append((tuple(ins), (Shard(d),) * n_out))
    packet = call.func.overloadpacket
    current = [s.placements[axis] for s in specs]
    partials = {p for p in current if isinstance(p, Partial) and p.reduce_op in ("sum", "avg")}
    out_dtype = out_meta.dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        # Integer sums stay Partial (as in torch); a cast to an integer type or a
        # comparison does not commute with sums.
        same_integers = out_dtype != torch.bool and all(
            s.tensor_meta.dtype == out_dtype for s in specs
        )
        if not same_integers:
            partials = set()
    for p in {p for p in current if isinstance(p, Partial) and p.reduce_op in ("max", "min")}:
        # max(max_i a_i, b) = max_i max(a_i, b), and likewise for min: torch keeps them
        if packet in _EXTREMES.get(p.reduce_op, ()):
            cands.append(((p,) * len(specs), (p,) * n_out))
            for i in range(len(specs)):
                ins3: list[Placement] = [Replicate()] * len(specs)
                ins3[i] = p
                cands.append((tuple(ins3), (p,) * n_out))
    for p in partials:
        if packet in _LINEAR_UNARY and len(specs) == 1:
            cands.append(((p,), (p,) * n_out))
        elif packet in _LINEAR_SUM and not _has_scalar_addend(call):
            cands.append(((p,) * len(specs), (p,) * n_out))
            if len(specs) > 1 and any(c != p for c in current) and not call.kwargs:
                # P + R stays P with no communication, as torch: the replicated addend is
                # added once (on the first rank of a sum axis; see add_once_into_partial)
                ins_sum = tuple(p if c == p else Replicate() for c in current)
                cands.append((ins_sum, (p,) * n_out))
        elif packet in _LINEAR_PRODUCT:
            if len(specs) == 1:
                cands.append(((p,), (p,) * n_out))
            else:
                first_only = packet in (aten.div, aten.div_)
                for i in range(1 if first_only else len(specs)):
                    ins2: list[Placement] = [Replicate()] * len(specs)
                    ins2[i] = p
                    cands.append((tuple(ins2), (p,) * n_out))
    if specs and isinstance(current[0], Partial) and _writes_partial_exactly(call):
        cands.append(((current[0],) + (Replicate(),) * (len(specs) - 1), (current[0],) * n_out))
    if packet in _OVERWRITES and specs and isinstance(current[0], Partial):
        # fill_/zero_ write every local element: a Partial target stays Partial, as in
        # torch (fill_(v) of a Partial(sum) over n ranks then holds n * v).
        cands.append(((current[0],) + (Replicate(),) * (len(specs) - 1), (current[0],) * n_out))
    cands.append(((Replicate(),) * len(specs), (Replicate(),) * n_out))
    return cands


def _writes_partial_exactly(call: OpCall) -> bool:
    """An in-place op that keeps a Partial target exact: a scalar added once, a scalar fill.

    ``p.add_(c)`` adds ``c`` on the first rank of each Partial("sum") axis only;
    ``p.masked_fill_(mask, v)`` fills ``v`` there and ``0`` elsewhere (every rank, for
    avg/max/min). torch has no layout for these and raises.
    """
    packet = call.func.overloadpacket
    if packet in (aten.add_, aten.sub_):
        return len(call.specs) == 1 and _has_scalar_addend(call)
    if packet is aten.masked_fill_:
        return len(call.specs) == 2 and not isinstance(call.args[2], DTensorSpec)
    return False


def _on_other_ranks_of_a_sum(func: torch._ops.OpOverload) -> Any:
    """What a rank that is not first along a Partial("sum") axis does for such an op."""
    if func.overloadpacket is aten.masked_fill_:
        return lambda x, mask, value: x.masked_fill_(mask, 0)
    return lambda x, *args, **kwargs: x  # add_/sub_: the scalar is added on the first rank


def pointwise_rule(call: OpCall) -> Decision:
    """The rule for element-wise ops."""
    if call.out_metas[0] is None:
        return None  # type: ignore[return-value]
    decision = choose(call, lambda axis: pointwise_candidates(call, axis))
    if call.func.overloadpacket in _LINEAR_SUM and len(call.specs) > 1:
        positions = [k for k, a in enumerate(call.args) if isinstance(a, DTensorSpec)]
        if len(positions) == len(call.specs):
            decision.local_fn = add_once_into_partial(call, decision, list(enumerate(positions)))
    if _writes_partial_exactly(call):
        coordinate = call.mesh.get_coordinate() or [0] * call.mesh.ndim
        sum_axes = [
            axis
            for axis, p in enumerate(decision.inputs[0])
            if isinstance(p, Partial) and p.reduce_op == "sum"
        ]
        if any(coordinate[axis] != 0 for axis in sum_axes):
            decision.local_fn = _on_other_ranks_of_a_sum(call.func)
    return decision


def is_pointwise(func: torch._ops.OpOverload) -> bool:
    """True for ops torch tags as element-wise."""
    return torch.Tag.pointwise in func.tags


register_rule(
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.positive.default,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.copy_.default,
    aten.lift_fresh.default,
    aten.native_dropout_backward.default,
)(pointwise_rule)


register_tag_rule(torch.Tag.pointwise, pointwise_rule)

"""Sharding rules of ops that work along some dims and map the others one to one.

``cumsum``, ``flip``, ``roll``, ``tril``/``triu``, ``logsumexp``, ``topk``, ``repeat``,
``constant_pad_nd``: a shard of a dim the op does not touch stays sharded (at the dim's
place in the output); a shard of a dim it works along is gathered first, as torch does.
Partial inputs are reduced first, except that ``cumsum``, ``flip``, ``roll``,
``tril``/``triu`` and ``constant_pad_nd`` with value 0 keep a Partial sum (they are
linear).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_R = Replicate()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _keep_other_dims(
    call: OpCall, dim_map: Sequence[int | None], *, keep_sum_partial: bool = False
) -> Decision:
    """Shard(d) -> Shard(dim_map[d]) (Replicate where None); Partial reduced unless kept."""
    spec = call.specs[0]
    ins: list[Placement] = []
    outs: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard) and dim_map[p.dim] is not None:
            ins.append(p)
            outs.append(Shard(dim_map[p.dim]))  # type: ignore[arg-type]
        elif isinstance(p, Partial) and keep_sum_partial and p.reduce_op in ("sum", "avg"):
            ins.append(p)
            outs.append(p)
        else:
            ins.append(_R)
            outs.append(_R)
    n_out = len(call.out_metas)
    return Decision(
        [tuple(ins)] + [(_R,) * call.mesh.ndim] * (len(call.specs) - 1), [tuple(outs)] * n_out
    )


def _cumsum_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = _norm(call.args[1] if len(call.args) > 1 else call.kwargs["dim"], spec.ndim)
    floating = spec.tensor_meta.dtype.is_floating_point or spec.tensor_meta.dtype.is_complex
    dim_map = [None if d == dim else d for d in range(spec.ndim)]
    return _keep_other_dims(call, dim_map, keep_sum_partial=floating)


def _flip_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    flipped = {_norm(d, spec.ndim) for d in call.args[1]}
    floating = spec.tensor_meta.dtype.is_floating_point or spec.tensor_meta.dtype.is_complex
    dim_map = [None if d in flipped else d for d in range(spec.ndim)]
    return _keep_other_dims(call, dim_map, keep_sum_partial=floating)


def _roll_rule(call: OpCall) -> Decision:
    """``roll`` along given dims: shards of the other dims stay (no ``dims``: flattened, replicate)."""
    spec = call.specs[0]
    dims = call.args[2] if len(call.args) > 2 else call.kwargs.get("dims", [])
    if not dims:
        return _keep_other_dims(call, [None] * spec.ndim)
    rolled = {_norm(d, spec.ndim) for d in dims}
    dim_map = [None if d in rolled else d for d in range(spec.ndim)]
    return _keep_other_dims(call, dim_map, keep_sum_partial=True)


def _triangle_rule(call: OpCall) -> Decision:
    """``tril`` / ``triu``: the batch dims shard freely, the last two are replicated."""
    spec = call.specs[0]
    dim_map = [d if d < spec.ndim - 2 else None for d in range(spec.ndim)]
    return _keep_other_dims(call, dim_map, keep_sum_partial=True)


def _reducing_rule(call: OpCall) -> Decision:
    """logsumexp(dims, keepdim): a shard of a reduced dim is gathered."""
    spec = call.specs[0]
    ndim = spec.ndim
    raw = call.args[1] if len(call.args) > 1 else call.kwargs["dim"]
    reduced = {_norm(d, ndim) for d in ([raw] if isinstance(raw, int) else raw)} or set(range(ndim))
    keepdim = bool(call.args[2] if len(call.args) > 2 else call.kwargs.get("keepdim", False))
    dim_map: list[int | None] = []
    for d in range(ndim):
        if d in reduced:
            dim_map.append(None)
        else:
            dim_map.append(d if keepdim else d - sum(1 for r in reduced if r < d))
    return _keep_other_dims(call, dim_map)


def _topk_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = _norm(call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", -1), spec.ndim)
    return _keep_other_dims(call, [None if d == dim else d for d in range(spec.ndim)])


def _repeat_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    repeats = list(call.args[1])
    offset = len(repeats) - spec.ndim
    dim_map = [d + offset if repeats[d + offset] == 1 else None for d in range(spec.ndim)]
    return _keep_other_dims(call, dim_map)


def _pad_rule(call: OpCall) -> Decision:
    """constant_pad_nd(pad, value): ``pad`` lists (before, after) pairs from the last dim back."""
    spec = call.specs[0]
    pad = list(call.args[1])
    padded = {spec.ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    value = call.args[2] if len(call.args) > 2 else call.kwargs.get("value", 0)
    # padding with zeros is linear: a Partial sum stays Partial (as torch)
    return _keep_other_dims(
        call, [None if d in padded else d for d in range(spec.ndim)], keep_sum_partial=value == 0
    )


register_rule(aten.cumsum.default)(_cumsum_rule)
register_rule(aten.flip.default)(_flip_rule)
register_rule(aten.roll.default)(_roll_rule)
register_rule(aten.tril.default, aten.triu.default)(_triangle_rule)
register_rule(aten.logsumexp.default)(_reducing_rule)
register_rule(aten.topk.default)(_topk_rule)
register_rule(aten.repeat.default)(_repeat_rule)
register_rule(aten.constant_pad_nd.default)(_pad_rule)

"""Sharding rules of complex views: lazy conjugation and negation, view_as_real/view_as_complex.

``_conj`` and ``_neg_view`` return views whose conjugate (negative) bit is set; the
local view keeps the bit and :class:`DTensor` carries it on the wrapper too, so later
ops resolve it exactly as torch does. All four are linear, so a Partial(sum/avg)
input stays Partial; a shard keeps its dim, except that a shard of the last dim
(the real/imaginary pair) of ``view_as_complex`` is gathered.
"""

from __future__ import annotations

import torch

from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_R = Replicate()


def _complex_view_rule(call: OpCall) -> Decision:
    """Keep every Shard (but a shard of view_as_complex's pair dim) and every linear Partial."""
    spec = call.specs[0]
    pair_dim = spec.ndim - 1 if call.func is aten.view_as_complex.default else None
    placements: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim == pair_dim:
            placements.append(_R)
        elif isinstance(p, Partial) and p.reduce_op not in ("sum", "avg"):
            placements.append(_R)  # conj/negation do not commute with max/min
        else:
            placements.append(p)
    layout = tuple(placements)
    return Decision([layout], [layout])


register_rule(
    aten._conj.default,
    aten._neg_view.default,
    aten.view_as_real.default,
    aten.view_as_complex.default,
)(_complex_view_rule)

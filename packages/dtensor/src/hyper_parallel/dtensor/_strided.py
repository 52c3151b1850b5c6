"""Sharding rules on strided shards: a rule sees ``_StridedShard`` as the ``Shard`` it permutes.

A ``_StridedShard(d, sf)`` holds the positions of a ``Shard(d)`` chunk permuted the same
way on every rank. An op that treats the positions of a dim independently (pointwise,
foreach, matrix products, reductions, transposes) gives the same answer on permuted
positions: its rule is shown ``Shard(d)``, and every ``Shard`` of the decision on that
mesh axis (inputs and outputs, along dims of the strided dim's size) is read back as
``_StridedShard(., sf)``. View rules read it as it is (``_ops/strided_views.py``: flatten
and unflatten keep it); any other rule is shown ``Replicate()`` there, so the strided
input moves to whatever the rule asks (one all-gather at most): correct, never fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hyper_parallel.dtensor._registry import Decision, OpCall
from hyper_parallel.dtensor._spec import DTensorSpec
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard, _StridedShard

__all__ = ["has_strided", "keeps_strided", "restore_strided", "sees_strided", "shown_call"]

aten = torch.ops.aten

# ops (besides pointwise and foreach ones) whose rules never read a shard's position
_POSITION_FREE = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "sum",
        "mean",
        "amax",
        "amin",
        "linalg_vector_norm",
        "norm",
        "clone",
        "_to_copy",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "fill",
        "zero",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "alias",
        "contiguous",
        "threshold_backward",
        "where",
    }
)


def has_strided(specs: list[DTensorSpec]) -> bool:
    """True when some spec holds a ``_StridedShard``."""
    return any(isinstance(p, _StridedShard) for s in specs for p in s.placements)


# ops whose rules read _StridedShard themselves (views: flatten and unflatten keep it)
_SEES_STRIDED = frozenset({"view", "_unsafe_view"})


def sees_strided(func: torch._ops.OpOverload) -> bool:
    """True for ops whose rules are shown ``_StridedShard`` as it is.

    Example::

        sees_strided(torch.ops.aten.view.default)   # True
    """
    return func._schema.name.split("::")[-1] in _SEES_STRIDED


def keeps_strided(func: torch._ops.OpOverload) -> bool:
    """True for ops whose rules may be shown a strided shard as a ``Shard``.

    Example::

        keeps_strided(torch.ops.aten.mul.Tensor)   # True: pointwise
    """
    name = func._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        return True
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    if base in _POSITION_FREE or torch.Tag.pointwise in func.tags:
        return True
    functional = getattr(aten, base, None)
    overload = getattr(functional, func._overloadname, None) if functional is not None else None
    return isinstance(overload, torch._ops.OpOverload) and torch.Tag.pointwise in overload.tags


def _shown(p: Placement, as_shard: bool) -> Placement:
    if isinstance(p, _StridedShard):
        return Shard(p.dim) if as_shard else Replicate()
    return p


def shown_call(call: OpCall, *, as_shard: bool) -> OpCall:
    """``call`` with every ``_StridedShard`` shown as ``Shard`` (``as_shard``) or ``Replicate``."""
    specs = [
        s.with_placements(tuple(_shown(p, as_shard) for p in s.placements)) for s in call.specs
    ]
    it = iter(specs)
    args = tuple(_swap(a, it) for a in call.args)
    kwargs = {k: _swap(v, it) for k, v in call.kwargs.items()}
    return OpCall(call.func, args, kwargs, specs, call.mesh, call.out_metas)


def _swap(value: Any, it: Iterator[DTensorSpec]) -> Any:
    if isinstance(value, DTensorSpec):
        return next(it)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, it) for v in value)
    return value


def _element_groups(call: OpCall) -> list[tuple[list[int], list[int]]]:
    """``(spec indices, output indices)`` of the independent element ops of a call.

    One group for an ordinary op; for a ``_foreach_`` op one per list index ``i`` (the
    ``i``-th tensor of every list argument and the ``i``-th output), shared DTensor
    arguments in every group.
    """
    if not call.func._schema.name.split("::")[-1].startswith("_foreach_"):
        return [(list(range(len(call.specs))), list(range(len(call.out_metas))))]
    shared: list[int] = []
    by_index: dict[int, list[int]] = {}
    k = 0
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, DTensorSpec):
            shared.append(k)
            k += 1
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, DTensorSpec):
                    by_index.setdefault(i, []).append(k)
                    k += 1
    return [
        (specs + shared, [i] if i < len(call.out_metas) else [])
        for i, specs in sorted(by_index.items())
    ]


def restore_strided(call: OpCall, decision: Decision) -> Decision | None:
    """A decision made on ``shown_call(call, as_shard=True)`` read back on the strided layout.

    ``None`` when it cannot be: strided inputs of different split factors or sizes on one
    mesh axis, or a ``Shard`` of the decision along a dim of another size.
    """
    inputs = [list(p) for p in decision.inputs]
    outputs = [None if o is None else list(o) for o in decision.outputs]
    for spec_group, out_group in _element_groups(call):
        for axis in range(call.mesh.ndim):
            strided = {
                (s.shape[p.dim], p.split_factor)
                for s in (call.specs[k] for k in spec_group)
                if isinstance(p := s.placements[axis], _StridedShard)
            }
            if not strided:
                continue
            if len(strided) > 1:
                return None
            ((size, sf),) = strided
            shaped: list[tuple[list[Placement], tuple[int, ...]]] = [
                (inputs[k], call.specs[k].shape) for k in spec_group
            ]
            for j in out_group:
                out, meta = outputs[j], call.out_metas[j]
                if out is not None and meta is not None:
                    shaped.append((out, meta.shape))
            for placements, shape in shaped:
                p = placements[axis]
                if isinstance(p, Shard):
                    if shape[p.dim] != size:
                        return None
                    placements[axis] = _StridedShard(p.dim, sf=sf)
    return Decision(
        [tuple(p) for p in inputs],
        [None if o is None else tuple(o) for o in outputs],
        local_fn=decision.local_fn,
        rewrite=decision.rewrite,
        reduces=decision.reduces,
    )

"""Sharding rules of the ``_foreach_*`` ops that optimizers and ``clip_grad_norm_`` use.

Element ``i`` of every list argument forms one element-wise op, planned like the
plain op (:func:`pointwise_candidates`), so a Partial gradient is reduced (to the
parameter's shard, by reduce-scatter, or to Replicate) before it meets a parameter.
An in-place op keeps each mutated tensor's layout: a parameter never changes
placements during an optimizer step. ``_foreach_norm`` of sharded tensors computes
local ``sum |x|^p`` and all-reduces the vector of those sums once per mesh axis.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._ops.pointwise import pointwise_candidates
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    partial_to_replicate,
    replicate_all,
)
from hyper_parallel.dtensor.collectives import all_reduce
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement, Replicate, Shard

aten = torch.ops.aten

# element-wise ops with a _foreach_ form (out of place and, where it exists, in place)
_ELEMENTWISE = (
    "add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "sqrt", "rsqrt", "neg", "pow",
    "maximum", "minimum", "clamp_min", "clamp_max", "abs", "exp", "log", "reciprocal", "sign",
    "sigmoid", "tanh", "zero", "copy",
)  # fmt: skip


def _base_op(func: torch._ops.OpOverload) -> Any:
    """The plain op whose element-wise semantics one index of a foreach op has."""
    name = func._schema.name.split("::")[1].removeprefix("_foreach_").rstrip("_")
    packet = getattr(aten, name)
    return getattr(packet, packet.overloads()[0])


def _list_len(call: OpCall) -> int:
    first = call.args[0]
    return len(first) if isinstance(first, (list, tuple)) else 1


def _spec_slots(call: OpCall) -> list[tuple[int | None, int]]:
    """For each spec (in argument order): (list index or None when shared, position in ``specs``)."""
    slots: list[tuple[int | None, int]] = []
    k = 0
    for value in (*call.args, *call.kwargs.values()):
        if isinstance(value, DTensorSpec):
            slots.append((None, k))
            k += 1
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, DTensorSpec):
                    slots.append((i, k))
                    k += 1
    return slots


def _index_value(value: Any, i: int, n: int, replicate: tuple[Placement, ...]) -> Any:
    """Element ``i`` of a list argument of length ``n``; a shared DTensor's spec as Replicate."""
    if isinstance(value, (list, tuple)) and len(value) == n:
        return value[i]
    if isinstance(value, DTensorSpec):
        return value.with_placements(replicate)
    return value


def _foreach_rule(call: OpCall) -> Decision:
    """Plan each index like the plain element-wise op; in-place selves keep their layout."""
    n = _list_len(call)
    inplace = call.func._schema.name.endswith("_")
    base = _base_op(call.func)
    mesh = call.mesh
    replicate = replicate_all(mesh.ndim)
    slots = _spec_slots(call)
    inputs: list[tuple[Placement, ...]] = [replicate] * len(call.specs)
    outputs: list[tuple[Placement, ...] | None] = [None] * len(call.out_metas)
    for i in range(n):
        # shared tensors (a clip coefficient, a step size) are read as Replicate by every index
        sub_args = tuple(_index_value(a, i, n, replicate) for a in call.args)
        sub_kwargs = {k: _index_value(v, i, n, replicate) for k, v in call.kwargs.items()}
        positions = [k for (idx, k) in slots if idx == i or idx is None]
        shared = {k for (idx, k) in slots if idx is None}
        sub_specs = [
            call.specs[k].with_placements(replicate) if k in shared else call.specs[k]
            for k in positions
        ]
        self_spec = sub_specs[0]
        if inplace:
            out_meta: TensorMeta | None = self_spec.tensor_meta
        else:
            out_meta = call.out_metas[i] if i < len(call.out_metas) else None
        if out_meta is None:
            return None  # type: ignore[return-value]
        sub = OpCall(base, sub_args, sub_kwargs, sub_specs, mesh, [out_meta])
        shared_pos = [j for j, k in enumerate(positions) if k in shared]

        def candidates(
            axis: int, sub: OpCall = sub, shared_pos: list[int] = shared_pos
        ) -> list[Candidate]:
            cands = [
                c for c in pointwise_candidates(sub, axis)
                if all(c[0][j] == Replicate() for j in shared_pos)
            ]  # fmt: skip
            if inplace:
                current = sub.specs[0].placements[axis]
                kept = [c for c in cands if c[0][0] == current and c[1][0] == current]
                cands = kept or cands
            return cands

        decision = choose(sub, candidates, n_outputs=1)
        for j, k in enumerate(positions):
            if k not in shared:
                inputs[k] = decision.inputs[j]
        if not inplace and i < len(outputs):
            outputs[i] = decision.outputs[0]
    return Decision(inputs, outputs)


# -- norms ------------------------------------------------------------------------------


def _norm_rule(call: OpCall) -> Decision:
    """``_foreach_norm``: shards reduce locally, one all-reduce per mesh axis for the whole list.

    The plan does not depend on ``ord`` (the dispatcher keys foreach plans by argument
    types): the local function reads it on every call.
    """
    specs = call.specs
    mesh = call.mesh
    replicate = replicate_all(mesh.ndim)
    inputs = [partial_to_replicate(s.placements) for s in specs]
    axes_of = [tuple(a for a, q in enumerate(pl) if isinstance(q, Shard)) for pl in inputs]
    decision = Decision(inputs, [replicate] * len(call.out_metas))
    if any(axes_of):
        decision.local_fn = _sharded_norms(axes_of, mesh)
        decision.reduces = tuple(sorted({a for axes in axes_of for a in axes}))
    return decision


def _local_part(t: torch.Tensor, p: float, dtype: torch.dtype | None) -> torch.Tensor:
    """What a shard contributes to the norm: max/min |x|, the count of nonzeros, or sum |x|^p."""
    x = t.abs() if dtype is None else t.to(dtype).abs()
    if math.isinf(p):
        if x.numel() == 0:
            return torch.full((), 0.0 if p > 0 else math.inf, dtype=x.dtype)
        return x.amax() if p > 0 else x.amin()
    if p == 0:
        return (x != 0).sum().to(x.dtype)
    powered: torch.Tensor = torch.linalg.vector_norm(x, p) ** p
    return powered


def _sharded_norms(axes_of: list[tuple[int, ...]], mesh: DeviceMesh) -> Any:
    mesh_shape = mesh.shape

    def local_norms(
        tensors: list[torch.Tensor], ord: Any = 2, dtype: Any = None
    ) -> list[torch.Tensor]:
        p = float(ord)
        parts = [_local_part(t, p, dtype) if axes_of[i] else t for i, t in enumerate(tensors)]
        op: Literal["sum", "max", "min"] = "sum"
        if math.isinf(p):
            op = "max" if p > 0 else "min"
        for axis in range(mesh.ndim):
            members = [i for i, axes in enumerate(axes_of) if axis in axes]
            if not members or mesh_shape[axis] == 1:
                continue
            packed = torch.stack([parts[i] for i in members])
            reduced = all_reduce(packed, mesh, axis, op)
            for j, i in enumerate(members):
                parts[i] = reduced[j]
        out: list[torch.Tensor] = []
        for i, part in enumerate(parts):
            if not axes_of[i]:
                out.append(torch.linalg.vector_norm(part, p, dtype=dtype))
            elif math.isinf(p) or p == 0:
                out.append(part.clone())
            else:
                out.append(part ** (1.0 / p))
        return out

    return local_norms


def _overloads(name: str) -> list[Any]:
    packet = getattr(aten, name, None)
    if packet is None:
        return []
    return [getattr(packet, o) for o in packet.overloads() if "out" not in o]


_OUT_OF_PLACE = [op for base in _ELEMENTWISE for op in _overloads(f"_foreach_{base}")]
_IN_PLACE = [op for base in _ELEMENTWISE for op in _overloads(f"_foreach_{base}_")]


register_rule(*_OUT_OF_PLACE, *_IN_PLACE)(_foreach_rule)
register_rule(aten._foreach_norm.Scalar)(_norm_rule)

"""The phases of a plan's derivation that need no DTensor: decision, moves, outputs, relabels."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._plan import OpInfo, Placements, Plan, Result, _Mutation
from hyper_parallel.dtensor._registry import Decision, Declined, OpCall, Rule
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, local_shape_and_offset
from hyper_parallel.dtensor._strided import (
    keeps_strided,
    restore_strided,
    sees_strided,
    shown_call,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial


class RuleError(RuntimeError):
    """A sharding rule gave an impossible answer (a bug in the rule, not a fallback)."""


def _decide(rule: Rule, call: OpCall) -> Decision | str:
    """The rule's decision, checked (a str: why the rule declined the call).

    A rule that raises is a bug and its error propagates, as does an impossible
    answer (:class:`RuleError`): only "no rule" and "declined" take the fallback.
    """
    try:
        decision = rule(call)
    except Declined as exc:
        return f"its sharding rule declined this call ({exc})"
    if decision is None:
        return "its sharding rule declined this call"
    problem = _check_decision(decision, call.specs, call.out_metas)
    if problem:
        raise RuleError(f"{call.func}: its sharding rule gave {problem}")
    return decision


def _decide_on_strided(rule: Rule, call: OpCall) -> Decision | str:
    """The decision of a call with strided shards (see ``_strided``): kept where the op allows."""
    if sees_strided(call.func):
        decision = _decide(rule, call)
        if not isinstance(decision, str):
            return decision
    elif keeps_strided(call.func):
        decision = _decide(rule, shown_call(call, as_shard=True))
        if not isinstance(decision, str):
            restored = restore_strided(call, decision)
            if restored is not None:
                return restored
    return _decide(rule, shown_call(call, as_shard=False))


def _check_decision(
    decision: Decision, specs: list[DTensorSpec], out_metas: list[TensorMeta | None]
) -> str:
    """What is wrong with a rule's decision ('' when nothing)."""
    if len(decision.inputs) != len(specs):
        return f"{len(decision.inputs)} input layouts for {len(specs)} DTensor arguments"
    if len(decision.outputs) != len(out_metas):
        return f"{len(decision.outputs)} output layouts for {len(out_metas)} outputs"
    for spec, target in zip(specs, decision.inputs, strict=True):
        if len(target) != len(spec.placements):
            return f"input layout {target} for a {len(spec.placements)}-axis mesh"
        for src, dst in zip(spec.placements, target, strict=True):
            if isinstance(dst, Partial) and src != dst:
                return f"an unreachable input layout {dst!r} (from {src!r})"
    for meta, placements in zip(out_metas, decision.outputs, strict=True):
        if meta is not None and placements is None:
            return "no layout for a tensor output"
    n_axes = len(specs[0].placements) if specs else 0
    if any(not 0 <= axis < n_axes for axis in decision.reduces):
        return f"in-kernel reductions over mesh axes {decision.reduces} of a {n_axes}-axis mesh"
    return ""


def _moves(
    specs: list[DTensorSpec], decision: Decision
) -> tuple[tuple[tuple[int, Placements], ...], tuple[DTensorSpec | None, ...]]:
    """The inputs that move (index, target) and each DTensor's spec after its move."""
    moves: list[tuple[int, Placements]] = []
    moved_specs: list[DTensorSpec | None] = []
    for i, (spec, target) in enumerate(zip(specs, decision.inputs, strict=True)):
        target = tuple(target)
        if target != spec.placements:
            moves.append((i, target))
            moved_specs.append(spec.with_placements(target))
        else:
            moved_specs.append(None)
    return tuple(moves), tuple(moved_specs)


def _outputs(
    mesh: DeviceMesh, out_metas: list[TensorMeta | None], decision: Decision
) -> tuple[tuple[DTensorSpec | None, ...], list[tuple[int, ...] | None]]:
    """Each output's spec and this rank's local shape of it (None for non-tensors)."""
    out_specs: list[DTensorSpec | None] = []
    out_local_shapes: list[tuple[int, ...] | None] = []
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    for meta, placements in zip(out_metas, decision.outputs, strict=True):
        if meta is None or placements is None:
            out_specs.append(None)
            out_local_shapes.append(None)
        else:
            out_specs.append(DTensorSpec(mesh, tuple(placements), meta))
            shape, _ = local_shape_and_offset(meta.shape, mesh.shape, coordinate, placements)
            out_local_shapes.append(shape)
    return tuple(out_specs), out_local_shapes


def _relabel(
    mutation: _Mutation,
    specs: list[DTensorSpec],
    moved_specs: tuple[DTensorSpec | None, ...],
    out_specs: tuple[DTensorSpec | None, ...],
) -> tuple[tuple[int, DTensorSpec], ...]:
    """The returned written DTensors whose placements the op changes (``transpose_`` and kin)."""
    if mutation.result is not Result.ALIASES:
        return ()
    relabel: list[tuple[int, DTensorSpec]] = []
    for indices, out_spec in zip(mutation.returned, out_specs, strict=False):
        if len(indices) == 1 and out_spec is not None:
            i = indices[0]
            before = moved_specs[i] or specs[i]
            if out_spec.placements != before.placements:
                relabel.append((i, before.with_placements(out_spec.placements)))
    return tuple(relabel)


def _fallback_plan(info: OpInfo, mutation: _Mutation, reason: str) -> Plan:
    return Plan(
        fallback=True,
        fn=info.func,
        mutated=mutation.mutated,
        result=mutation.result,
        returned=mutation.returned,
        reason=reason,
    )


def _meta_like(spec: DTensorSpec) -> torch.Tensor:
    meta = spec.tensor_meta
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def _flatten_outputs(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        flat: list[Any] = []
        for o in out:
            flat.extend(_flatten_outputs(o))
        return flat
    return [out]

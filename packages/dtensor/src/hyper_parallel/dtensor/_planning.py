"""Sharding plans: the rule registry, and deriving (and caching) one plan per op and layout.

A rule sees an :class:`OpCall` (the call with each DTensor replaced by its spec,
plus the global metadata of the outputs, from running the op on meta tensors) and
answers a :class:`Decision` (input and output placements, optionally a local
function). :func:`_make_plan` turns that into a :class:`_Plan` with everything a
call needs precomputed: which inputs move, the output specs, what the op writes
and returns. Plans are cached per op (:class:`_OpInfo`), keyed by argument specs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.dtensor._api import DTensor
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, local_shape_and_offset
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement

__all__ = [
    "Decision",
    "OpCall",
    "clear_plan_cache",
    "plan_cache_size",
    "plan_derivations",
    "register_rule",
    "register_special",
    "register_tag_rule",
    "rule_for",
]

aten = torch.ops.aten

Placements = tuple[Placement, ...]


@dataclass(slots=True)
class OpCall:
    """What a sharding rule sees of one op call.

    ``args``/``kwargs`` hold the call's arguments with each DTensor replaced by its
    :class:`DTensorSpec`; ``specs`` lists those specs in argument order;
    ``out_metas`` the global metadata of each tensor output (``None`` for
    non-tensor outputs), in output order.
    """

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    specs: list[DTensorSpec]
    mesh: DeviceMesh
    out_metas: list[TensorMeta | None]


LocalFn = Callable[..., Any]


Rewrite = Callable[
    [Sequence[Any], dict[str, Any], list[tuple[int, ...] | None]],
    tuple[Sequence[Any], dict[str, Any]],
]


@dataclass(slots=True)
class Decision:
    """A rule's answer: input placements (per spec), output placements (per output).

    ``local_fn`` replaces the op for the local computation (called like the op,
    on local tensors); ``rewrite(args, kwargs, out_local_shapes)`` rewrites the
    non-tensor arguments of the local call (e.g. a view's target shape).
    """

    inputs: list[Placements]
    outputs: list[Placements | None]
    local_fn: LocalFn | None = None
    rewrite: Rewrite | None = None


Rule = Callable[[OpCall], "Decision | None"]


Special = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any]


_RULES: dict[Any, Rule] = {}


_TAG_RULES: dict[Any, Rule] = {}


_SPECIALS: dict[Any, Special] = {}


def register_rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a sharding rule for op overloads (or whole overload packets).

    Example::

        @register_rule(torch.ops.aten.relu.default)
        def relu_rule(call: OpCall) -> Decision: ...
    """

    def deco(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        _OPS.clear()
        return rule

    return deco


def register_special(*ops: Any) -> Callable[[Special], Special]:
    """Register a handler that takes the whole call (for ops that are not shard-local).

    Example::

        @register_special(torch.ops.aten.detach.default)
        def detach(func, args, kwargs): ...
    """

    def deco(handler: Special) -> Special:
        for op in ops:
            _SPECIALS[op] = handler
        _OPS.clear()
        return handler

    return deco


def register_tag_rule(tag: Any, rule: Rule) -> None:
    """Register the rule of every op carrying ``tag`` (e.g. ``torch.Tag.pointwise``).

    Example::

        register_tag_rule(torch.Tag.pointwise, pointwise_rule)
    """
    _TAG_RULES[tag] = rule
    _OPS.clear()


def rule_for(func: torch._ops.OpOverload) -> Rule | None:
    """The rule of an op overload, of its overload packet, or of one of its tags.

    An in-place op (``mul_``) without a rule of its own takes the tag rule of its
    functional form (``mul``), which torch tags more consistently.
    """
    rule = _RULES.get(func) or _RULES.get(func.overloadpacket)
    if rule is None:
        rule = _tag_rule(func)
    if rule is None and func._schema.name.endswith("_"):
        functional = getattr(aten, func._schema.name.split("::")[-1][:-1], None)
        overload = getattr(functional, func._overloadname, None) if functional is not None else None
        if isinstance(overload, torch._ops.OpOverload):
            rule = _tag_rule(overload)
    return rule


def _tag_rule(func: torch._ops.OpOverload) -> Rule | None:
    for tag in func.tags:
        rule = _TAG_RULES.get(tag)
        if rule is not None:
            return rule
    return None


_derivations = [0]


def plan_derivations() -> int:
    """How many sharding decisions were derived (cache misses) since the process started.

    Example::

        n = plan_derivations(); dt + dt; dt + dt; plan_derivations() - n  # 1 (or 0 if cached)
    """
    return _derivations[0]


# How an op's result is built from the local call's result.
_WRAP = 0  # wrap every tensor output with its planned spec


_ALIASES = 1  # return the written DTensor arguments the schema's returns alias


_NOTHING = 2  # the op returns nothing (e.g. in-place foreach ops)


_MAX_PLANS_PER_OP = 1024


@dataclass(slots=True)
class _OpInfo:
    """What the dispatcher knows about one op overload, computed once."""

    func: torch._ops.OpOverload
    special: Special | None
    rule: Rule | None
    floats_by_type: bool  # float arguments key the cache by type only (the rule ignores values)
    written: tuple[str, ...]  # names of the arguments the op writes
    return_aliases: tuple[str | None, ...]  # per schema return: the written argument it is
    plans: dict[Any, _Plan] = field(default_factory=dict)


@dataclass(slots=True)
class _Plan:
    """Everything one call needs, precomputed from the rule's decision."""

    fallback: bool
    fn: LocalFn
    moves: tuple[tuple[int, Placements], ...] = ()  # (DTensor index, target) of moving inputs
    moved_specs: tuple[DTensorSpec | None, ...] = ()  # spec after the move, per DTensor
    mutated: tuple[int, ...] = ()  # DTensor indices the op writes
    relabel: tuple[
        tuple[int, DTensorSpec], ...
    ] = ()  # written DTensors whose layout the op changes
    result: int = _WRAP
    returned: tuple[tuple[int, ...], ...] = ()  # per return: DTensor indices it aliases
    single: DTensorSpec | None = None  # the op returns one tensor, wrapped with this spec
    out_specs: tuple[DTensorSpec | None, ...] = ()
    out_local_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    rewrite: Rewrite | None = None
    reason: str = ""


_OPS: dict[int, _OpInfo] = {}


def _op_info(func: torch._ops.OpOverload) -> _OpInfo:
    info = _OPS.get(id(func))
    if info is None:
        schema = func._schema
        written = tuple(
            a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        )
        aliases: list[str | None] = []
        for r in schema.returns:
            name = None
            if r.alias_info is not None and r.alias_info.is_write:
                for a in schema.arguments:
                    ai = a.alias_info
                    if ai is not None and ai.is_write and ai.before_set == r.alias_info.before_set:
                        name = a.name
                        break
            aliases.append(name)
        info = _OpInfo(
            func=func,
            special=_SPECIALS.get(func),
            rule=rule_for(func),
            floats_by_type=torch.Tag.pointwise in func.tags
            or schema.name.startswith("aten::_foreach_"),
            written=written,
            return_aliases=tuple(aliases),
        )
        _OPS[id(func)] = info
    return info


def clear_plan_cache() -> None:
    """Forget every cached sharding decision.

    Example::

        clear_plan_cache(); plan_cache_size()  # 0
    """
    for info in _OPS.values():
        info.plans.clear()


def plan_cache_size() -> int:
    """Number of cached sharding decisions.

    Example::

        n = plan_cache_size(); dt + dt; dt + dt; plan_cache_size() - n  # at most 1
    """
    return sum(len(info.plans) for info in _OPS.values())


def _aliased_result(plan: _Plan, out: Any, dtensors: list[DTensor]) -> Any:
    if plan.result == _NOTHING:
        return out
    results: list[Any] = []
    for indices in plan.returned:
        if len(indices) == 1:
            results.append(dtensors[indices[0]])
        else:
            results.append([dtensors[i] for i in indices])
    return results[0] if len(results) == 1 else tuple(results)


def _meta_like(spec: DTensorSpec) -> torch.Tensor:
    meta = spec.tensor_meta
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def _swap(value: Any, it: Iterator[Any]) -> Any:
    if isinstance(value, DTensor):
        return next(it)
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, (DTensor, list, tuple)) for v in value
    ):
        return type(value)(_swap(v, it) for v in value)
    return value


def _swap_all(
    args: tuple[Any, ...], kwargs: dict[str, Any], replacements: Sequence[Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with each DTensor replaced, in order, by ``replacements``."""
    it = iter(replacements)
    new_args = tuple(_swap(a, it) for a in args)
    new_kwargs = {k: _swap(v, it) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _flatten_outputs(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        flat: list[Any] = []
        for o in out:
            flat.extend(_flatten_outputs(o))
        return flat
    return [out]


def _count_dtensors(value: Any) -> int:
    if isinstance(value, DTensor):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count_dtensors(v) for v in value)
    return 0


def _dtensor_indices_by_argument(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Schema argument name -> indices (in dispatch order) of the DTensors it holds."""
    names = [a.name for a in func._schema.arguments]
    result: dict[str, tuple[int, ...]] = {}
    start = 0
    for i, a in enumerate(args):
        n = _count_dtensors(a)
        if i < len(names):
            result[names[i]] = tuple(range(start, start + n))
        start += n
    for k, v in kwargs.items():
        n = _count_dtensors(v)
        result[k] = tuple(range(start, start + n))
        start += n
    return result


def _fallback_plan(
    info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str
) -> _Plan:
    plan = _Plan(fallback=True, fn=info.func, reason=reason)
    _fill_mutation(plan, info, args, kwargs)
    return plan


def _fill_mutation(
    plan: _Plan, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Which DTensors the op writes, and which of them it returns."""
    if not info.written:
        return
    by_arg = _dtensor_indices_by_argument(info.func, args, kwargs)
    mutated: list[int] = []
    for name in info.written:
        mutated.extend(by_arg.get(name, ()))
    plan.mutated = tuple(mutated)
    if not info.return_aliases:
        plan.result = _NOTHING
    elif all(name is not None for name in info.return_aliases):
        plan.result = _ALIASES
        plan.returned = tuple(by_arg.get(name or "", ()) for name in info.return_aliases)
        if any(not r for r in plan.returned):  # a written argument is a plain tensor
            plan.result = _WRAP


def _make_plan(
    info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], dtensors: list[DTensor]
) -> _Plan:
    _derivations[0] += 1
    func = info.func
    rule = info.rule
    if rule is None:
        return _fallback_plan(info, args, kwargs, "it has no sharding rule")
    specs = [dt._spec for dt in dtensors]
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(
                f"{func}: DTensor arguments live on different meshes: {mesh} and {s.mesh}"
            )
    meta_args, meta_kwargs = _swap_all(args, kwargs, [_meta_like(s) for s in specs])
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")
    if meta_kwargs.get("pin_memory"):
        meta_kwargs["pin_memory"] = False
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except (NotImplementedError, RuntimeError) as exc:
        return _fallback_plan(info, args, kwargs, f"its meta computation failed ({exc})")
    out_flat = _flatten_outputs(meta_out)
    out_metas: list[TensorMeta | None] = [
        TensorMeta(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else None
        for o in out_flat
    ]
    spec_args, spec_kwargs = _swap_all(args, kwargs, specs)
    call = OpCall(func, spec_args, spec_kwargs, specs, mesh, out_metas)
    try:
        decision = rule(call)
    except Exception as exc:  # a rule that cannot handle this call: stay correct
        return _fallback_plan(
            info, args, kwargs, f"its sharding rule failed ({type(exc).__name__}: {exc})"
        )
    if decision is None:
        return _fallback_plan(info, args, kwargs, "its sharding rule declined this call")
    problem = _check_decision(decision, specs, out_metas)
    if problem:
        return _fallback_plan(info, args, kwargs, f"its sharding rule gave {problem}")

    plan = _Plan(fallback=False, fn=decision.local_fn or func._op, rewrite=decision.rewrite)
    moves: list[tuple[int, Placements]] = []
    moved_specs: list[DTensorSpec | None] = []
    for i, (spec, target) in enumerate(zip(specs, decision.inputs, strict=True)):
        target = tuple(target)
        if target != spec.placements:
            moves.append((i, target))
            moved_specs.append(spec.with_placements(target))
        else:
            moved_specs.append(None)
    plan.moves = tuple(moves)
    plan.moved_specs = tuple(moved_specs)
    _fill_mutation(plan, info, args, kwargs)

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
    plan.out_specs = tuple(out_specs)
    plan.out_local_shapes = out_local_shapes
    if plan.result == _ALIASES:
        relabel: list[tuple[int, DTensorSpec]] = []
        for indices, out_spec in zip(plan.returned, out_specs, strict=False):
            if len(indices) == 1 and out_spec is not None:
                i = indices[0]
                before = moved_specs[i] or specs[i]
                if out_spec.placements != before.placements:
                    relabel.append((i, before.with_placements(out_spec.placements)))
        plan.relabel = tuple(relabel)
    if plan.result == _WRAP and isinstance(meta_out, torch.Tensor):
        plan.single = out_specs[0]
    return plan


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
    return ""


def _wrap(out: Any, specs: Iterator[DTensorSpec | None]) -> Any:
    if isinstance(out, torch.Tensor):
        spec = next(specs)
        if spec is None:
            return out
        return DTensor(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, specs) for o in out)
    next(specs, None)
    return out

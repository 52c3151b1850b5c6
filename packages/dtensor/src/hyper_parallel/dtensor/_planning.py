"""Sharding plans: derive one per op and argument layouts, cache it, run it.

A plan is derived once per op and cache key (:func:`derive_plan`): the op runs on meta
tensors for the global output metadata, the op's rule (see ``_registry``) answers a
:class:`~hyper_parallel.dtensor._registry.Decision`, and everything a call needs is
precomputed: which inputs move, the output specs, what the op writes and returns.
:func:`run_plan` then does only that work per call.

An op without a usable rule (none registered, declined, failed, or an impossible
answer) gets a *fallback plan*: gather every input to Replicate, run the op on full
tensors, return Replicate, and write the new value of an in-place argument back in its
own layout (a Partial one becomes Replicate). Always correct, never fast: it warns once
per op (:class:`FallbackWarning`) and counts every call (:func:`fallback_counts`).

Nothing here imports the DTensor class: the dispatcher passes it in (``tensor_type``),
so the class can import the dispatcher openly and imports flow one way.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor import _registry
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._registry import Decision, LocalFn, OpCall, Rewrite, Rule, Special
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    local_shape_and_offset,
    replicate_all,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor

__all__ = [
    "FallbackWarning",
    "OpInfo",
    "Plan",
    "clear_plan_cache",
    "derive_plan",
    "fallback_counts",
    "op_info",
    "plan_cache_size",
    "plan_derivations",
    "reset_fallback_counts",
    "run_plan",
    "swap_dtensors",
]

Placements = tuple[Placement, ...]
TensorType = type["DTensor"]

# How an op's result is built from the local call's result.
WRAP = 0  # wrap every tensor output with its planned spec
ALIASES = 1  # return the written DTensor arguments the schema's returns alias
NOTHING = 2  # the op returns nothing (e.g. in-place foreach ops)

_MAX_PLANS_PER_OP = 1024


class FallbackWarning(UserWarning):
    """An op ran through the gather-compute-replicate fallback (correct, but slow)."""


_fallbacks: Counter[str] = Counter()
_derivations = [0]


def fallback_counts() -> dict[str, int]:
    """How many times each op has fallen back since the process started (or the last reset).

    Example::

        before = fallback_counts()
    """
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    """Forget the fallback counts.

    Example::

        reset_fallback_counts(); y = torch.sort(dt); fallback_counts()  # {'aten.sort.default': 1}
    """
    _fallbacks.clear()


def plan_derivations() -> int:
    """How many sharding decisions were derived (cache misses) since the process started.

    Example::

        n = plan_derivations(); dt + dt; dt + dt; plan_derivations() - n  # 1 (or 0 if cached)
    """
    return _derivations[0]


@dataclass(slots=True)
class OpInfo:
    """What planning knows about one op overload, computed once from its schema and the registry."""

    func: torch._ops.OpOverload
    special: Special | None
    rule: Rule | None
    floats_by_type: bool  # float arguments key the cache by type only (the rule ignores values)
    written: tuple[str, ...]  # names of the arguments the op writes
    return_aliases: tuple[str | None, ...]  # per schema return: the written argument it is
    plans: dict[Any, Plan] = field(default_factory=dict)


@dataclass(slots=True)
class Plan:
    """Everything one call needs, precomputed from the rule's decision (or a fallback plan)."""

    fallback: bool
    fn: LocalFn
    moves: tuple[tuple[int, Placements], ...] = ()  # (DTensor index, target) of moving inputs
    moved_specs: tuple[DTensorSpec | None, ...] = ()  # spec after the move, per DTensor
    mutated: tuple[int, ...] = ()  # DTensor indices the op writes
    relabel: tuple[
        tuple[int, DTensorSpec], ...
    ] = ()  # written DTensors whose layout the op changes
    result: int = WRAP
    returned: tuple[tuple[int, ...], ...] = ()  # per return: DTensor indices it aliases
    single: DTensorSpec | None = None  # the op returns one tensor, wrapped with this spec
    out_specs: tuple[DTensorSpec | None, ...] = ()
    out_local_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    rewrite: Rewrite | None = None
    reason: str = ""
    outside: bool = False  # this rank is not in the mesh: it holds empty locals, computes nothing
    returns_list: bool = False  # the op returns a Tensor[] (its outputs as a list)


def op_info(func: torch._ops.OpOverload) -> OpInfo:
    """The planning state of ``func`` (derived on first use, again after a registration).

    Example::

        op_info(torch.ops.aten.mm.default).rule   # the matrix-product rule
    """
    info: OpInfo | None = _registry.derived.get(id(func))
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
        rule = _registry.rule_for(func)
        special = _registry.special_for(func)
        if special is None and rule is None and _composite(func):
            special = _decompose
        info = OpInfo(
            func=func,
            special=special,
            rule=rule,
            floats_by_type=torch.Tag.pointwise in func.tags
            or schema.name.startswith("aten::_foreach_"),
            written=written,
            return_aliases=tuple(aliases),
        )
        _registry.derived[id(func)] = info
    return info


def _composite(func: torch._ops.OpOverload) -> bool:
    """True for ops torch defines by a decomposition (linear, matmul, reshape, ...)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(),  # type: ignore[no-untyped-call]
        torch._C.DispatchKey.CompositeImplicitAutograd,
    )


def _decompose(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a composite op as its decomposition, whose ops have rules.

    Such ops reach DTensors whole only where autograd is off (``inference_mode``);
    decomposing them there, as autograd does elsewhere, keeps e.g. a sharded weight
    of ``linear`` in place instead of gathering it in the fallback.
    """
    return func.decompose(*args, **kwargs)


def clear_plan_cache() -> None:
    """Forget every cached sharding decision.

    Example::

        clear_plan_cache(); plan_cache_size()  # 0
    """
    for info in _registry.derived.values():
        info.plans.clear()


def plan_cache_size() -> int:
    """Number of cached sharding decisions.

    Example::

        n = plan_cache_size(); dt + dt; dt + dt; plan_cache_size() - n  # at most 1
    """
    return sum(len(info.plans) for info in _registry.derived.values())


# -- deriving a plan -------------------------------------------------------------------


def derive_plan(
    tensor_type: TensorType,
    info: OpInfo,
    key: tuple[Any, ...] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
) -> Plan:
    """Derive the plan of a call and cache it under ``key`` (``None``: an uncacheable call).

    Example::

        plan = derive_plan(DTensor, op_info(aten.add.Tensor), key, (a, b), {}, [a, b])
    """
    plan = _make_plan(tensor_type, info, args, kwargs, dtensors)
    if key is not None:
        if len(info.plans) >= _MAX_PLANS_PER_OP:
            info.plans.clear()
        info.plans[key] = plan
    return plan


_KEEPS_WRITTEN_LAYOUT = (
    "no layout of its sharding rule keeps the placements of the tensor it writes in place"
)


def _make_plan(
    tensor_type: TensorType,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
) -> Plan:
    _derivations[0] += 1
    func = info.func
    rule = info.rule
    if rule is None:
        return _fallback_plan(tensor_type, info, args, kwargs, "it has no sharding rule")
    specs = [dt._spec for dt in dtensors]
    mesh = _common_mesh(func, specs)
    meta_args, meta_kwargs = swap_dtensors(
        tensor_type, args, kwargs, [_meta_like(s) for s in specs]
    )
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")
    if meta_kwargs.get("pin_memory"):
        meta_kwargs["pin_memory"] = False
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except (NotImplementedError, RuntimeError) as exc:
        reason = f"its meta computation failed ({exc})"
        return _fallback_plan(tensor_type, info, args, kwargs, reason)
    out_flat = _flatten_outputs(meta_out)
    out_metas: list[TensorMeta | None] = [
        TensorMeta(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else None
        for o in out_flat
    ]
    spec_args, spec_kwargs = swap_dtensors(tensor_type, args, kwargs, specs)
    call = OpCall(func, spec_args, spec_kwargs, specs, mesh, out_metas)
    try:
        decision = rule(call)
    except Exception as exc:  # a rule that cannot handle this call: stay correct
        reason = f"its sharding rule failed ({type(exc).__name__}: {exc})"
        return _fallback_plan(tensor_type, info, args, kwargs, reason)
    if decision is None:
        reason = "its sharding rule declined this call"
        return _fallback_plan(tensor_type, info, args, kwargs, reason)
    problem = _check_decision(decision, specs, out_metas)
    if problem:
        reason = f"its sharding rule gave {problem}"
        return _fallback_plan(tensor_type, info, args, kwargs, reason)

    plan = Plan(fallback=False, fn=decision.local_fn or func._op, rewrite=decision.rewrite)
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
    _fill_mutation(tensor_type, plan, info, args, kwargs)
    # An in-place or out= op keeps the layout of the tensor it writes (as torch), so views
    # of it stay valid; a rule that would move it gives way to the fallback, which
    # writes the result back in the tensor's own layout.
    keeps_layout = torch.Tag.inplace_view not in func.tags
    if keeps_layout and any(moved_specs[i] for i in plan.mutated):
        return _fallback_plan(tensor_type, info, args, kwargs, _KEEPS_WRITTEN_LAYOUT)

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
    plan.outside = mesh.get_coordinate() is None
    returns = func._schema.returns
    plan.returns_list = len(returns) == 1 and str(returns[0].type).startswith("List")
    if plan.result == ALIASES:
        relabel: list[tuple[int, DTensorSpec]] = []
        for indices, out_spec in zip(plan.returned, out_specs, strict=False):
            if len(indices) == 1 and out_spec is not None:
                i = indices[0]
                before = moved_specs[i] or specs[i]
                if out_spec.placements != before.placements:
                    relabel.append((i, before.with_placements(out_spec.placements)))
        if relabel and keeps_layout:
            return _fallback_plan(tensor_type, info, args, kwargs, _KEEPS_WRITTEN_LAYOUT)
        plan.relabel = tuple(relabel)
    if plan.result == WRAP and isinstance(meta_out, torch.Tensor):
        plan.single = out_specs[0]
    return plan


def _common_mesh(func: torch._ops.OpOverload, specs: Sequence[DTensorSpec]) -> DeviceMesh:
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(
                f"{func}: DTensor arguments live on different meshes: {mesh} and {s.mesh}"
            )
    return mesh


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


def _fallback_plan(
    tensor_type: TensorType,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
) -> Plan:
    plan = Plan(fallback=True, fn=info.func, reason=reason)
    _fill_mutation(tensor_type, plan, info, args, kwargs)
    return plan


def _fill_mutation(
    tensor_type: TensorType,
    plan: Plan,
    info: OpInfo,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Which DTensors the op writes, and which of them it returns."""
    if not info.written:
        return
    by_arg = _dtensor_indices_by_argument(tensor_type, info.func, args, kwargs)
    mutated: list[int] = []
    for name in info.written:
        mutated.extend(by_arg.get(name, ()))
    plan.mutated = tuple(mutated)
    if not info.return_aliases:
        plan.result = NOTHING
    elif all(name is not None for name in info.return_aliases):
        plan.result = ALIASES
        plan.returned = tuple(by_arg.get(name or "", ()) for name in info.return_aliases)
        if any(not r for r in plan.returned):  # a written argument is a plain tensor
            plan.result = WRAP


def _dtensor_indices_by_argument(
    tensor_type: TensorType,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, tuple[int, ...]]:
    """Schema argument name -> indices (in dispatch order) of the DTensors it holds."""
    names = [a.name for a in func._schema.arguments]
    result: dict[str, tuple[int, ...]] = {}
    start = 0
    for i, a in enumerate(args):
        n = _count_dtensors(tensor_type, a)
        if i < len(names):
            result[names[i]] = tuple(range(start, start + n))
        start += n
    for k, v in kwargs.items():
        n = _count_dtensors(tensor_type, v)
        result[k] = tuple(range(start, start + n))
        start += n
    return result


def _count_dtensors(tensor_type: TensorType, value: Any) -> int:
    if isinstance(value, tensor_type):
        return 1
    if isinstance(value, (list, tuple)):
        return sum(_count_dtensors(tensor_type, v) for v in value)
    return 0


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


def swap_dtensors(
    tensor_type: TensorType,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    replacements: Sequence[Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with each DTensor replaced, in order, by ``replacements``.

    Example::

        local_args, local_kwargs = swap_dtensors(DTensor, (a, 2), {}, [a._local_tensor])
    """
    it = iter(replacements)
    new_args = tuple(_swap(tensor_type, a, it) for a in args)
    new_kwargs = {k: _swap(tensor_type, v, it) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _swap(tensor_type: TensorType, value: Any, it: Iterator[Any]) -> Any:
    if isinstance(value, tensor_type):
        return next(it)
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, (tensor_type, list, tuple)) for v in value
    ):
        return type(value)(_swap(tensor_type, v, it) for v in value)
    return value


# -- running a plan --------------------------------------------------------------------


def run_plan(
    tensor_type: TensorType,
    plan: Plan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
    flat_locals: list[Any] | None,
) -> Any:
    """Run one call by its plan: move the inputs it names, compute locally, wrap the results.

    ``flat_locals`` is the local call's positional arguments when no DTensor sits in a
    list or in ``kwargs`` (the dispatcher collects it while keying), else ``None``.

    Example::

        out = run_plan(DTensor, plan, (a, b), {}, [a, b], [a._local_tensor, b._local_tensor])
    """
    if plan.fallback:
        return _run_fallback(tensor_type, plan, args, kwargs, dtensors)
    if plan.outside:
        return _outside_mesh_result(tensor_type, plan, dtensors)
    local_args: Sequence[Any]
    local_kwargs: dict[str, Any]
    if plan.moves:
        locals_ = [dt._local_tensor for dt in dtensors]
        for i, target in plan.moves:
            locals_[i] = redistribute_local(locals_[i], dtensors[i]._spec, target)
        for i in plan.mutated:
            moved = plan.moved_specs[i]
            if moved is not None:  # the op writes a tensor whose layout changes first
                dt = dtensors[i]
                dt._local_tensor = locals_[i]
                dt._spec = moved
        local_args, local_kwargs = swap_dtensors(tensor_type, args, kwargs, locals_)
    elif flat_locals is not None:
        local_args, local_kwargs = flat_locals, kwargs
    else:
        local_args, local_kwargs = swap_dtensors(
            tensor_type, args, kwargs, [dt._local_tensor for dt in dtensors]
        )
    if plan.rewrite is not None:
        local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.out_local_shapes)
    out = plan.fn(*local_args, **local_kwargs)
    single = plan.single
    if single is not None:
        return tensor_type(out, single)
    if plan.result == WRAP:
        return _wrap(tensor_type, out, iter(plan.out_specs))
    for i, spec in plan.relabel:
        dtensors[i]._spec = spec
    return _aliased_result(plan, out, dtensors)


def _wrap(tensor_type: TensorType, out: Any, specs: Iterator[DTensorSpec | None]) -> Any:
    if isinstance(out, torch.Tensor):
        spec = next(specs)
        if spec is None:
            return out
        return tensor_type(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(tensor_type, o, specs) for o in out)
    next(specs, None)
    return out


def _aliased_result(plan: Plan, out: Any, dtensors: list[DTensor]) -> Any:
    if plan.result == NOTHING:
        return out
    results: list[Any] = []
    for indices in plan.returned:
        if len(indices) == 1:
            results.append(dtensors[indices[0]])
        else:
            results.append([dtensors[i] for i in indices])
    return results[0] if len(results) == 1 else tuple(results)


def _run_fallback(
    tensor_type: TensorType,
    plan: Plan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
) -> Any:
    func = plan.fn
    name = str(func)
    _fallbacks[name] += 1
    if _fallbacks[name] == 1:
        warnings.warn(
            f"hyper_parallel.dtensor: {name} ran on full tensors (gathered to Replicate) and "
            f"returned Replicate because {plan.reason}. Correct, but it communicates and "
            "computes the whole tensor on every rank.",
            FallbackWarning,
            stacklevel=5,
        )
    if not dtensors:
        return func(*args, **kwargs)
    mesh = _common_mesh(func, [dt._spec for dt in dtensors])  # type: ignore[arg-type]
    replicate = replicate_all(mesh.ndim)
    fulls = [redistribute_local(dt._local_tensor, dt._spec, replicate) for dt in dtensors]
    full_args, full_kwargs = swap_dtensors(tensor_type, args, kwargs, fulls)
    out = func(*full_args, **full_kwargs)
    for i in plan.mutated:
        _write_back(dtensors[i], fulls[i])
    if plan.result == WRAP:
        return _wrap_replicated(tensor_type, out, mesh)
    return _aliased_result(plan, out, dtensors)


def _write_back(dt: DTensor, full: torch.Tensor) -> None:
    """Give a DTensor the new value of its full tensor in its own layout, in its own storage.

    The layout never changes (a Partial target gets its part of the value), so views of
    the target taken before the op stay valid, as with torch's in-place ops.
    """
    spec = dt._spec
    if full is dt._local_tensor:  # replicated: the op wrote its local tensor
        return
    if spec.mesh.get_coordinate() is None:
        return
    replicated = spec.with_placements(replicate_all(spec.mesh.ndim))
    dt._local_tensor.copy_(redistribute_local(full, replicated, spec.placements))


def _outside_mesh_result(tensor_type: TensorType, plan: Plan, dtensors: list[DTensor]) -> Any:
    """On a rank outside the mesh an op computes nothing: empty locals, as in torch."""
    if plan.result != WRAP:
        return _aliased_result(plan, None, dtensors)
    device = dtensors[0]._local_tensor.device
    outs = [
        None if spec is None else tensor_type(_outside_local(spec, device), spec)
        for spec in plan.out_specs
    ]
    if plan.single is not None:
        return outs[0]
    if plan.returns_list:
        return outs
    return outs[0] if len(outs) == 1 else tuple(outs)


def _outside_local(spec: DTensorSpec, device: torch.device) -> torch.Tensor:
    """torch's local tensor off the mesh: a 0-dim zero for a scalar result, else empty."""
    dtype = spec.tensor_meta.dtype
    if not spec.shape:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=device)


def _wrap_replicated(tensor_type: TensorType, out: Any, mesh: DeviceMesh) -> Any:
    if isinstance(out, torch.Tensor):
        meta = TensorMeta(out.shape, out.stride(), out.dtype)
        return tensor_type(out, DTensorSpec(mesh, replicate_all(mesh.ndim), meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(tensor_type, o, mesh) for o in out)
    return out

"""Running torch ops on DTensors: sharding rules, redistribution, a decision cache, a fallback.

For each op call the dispatcher builds a cache key from the op and its argument
specs. On a miss it runs the op on meta tensors of the global shapes (output
metadata), asks the op's sharding rule which placements the inputs must have and
which the outputs get, and stores that plan. Every call then redistributes the
inputs the plan names, runs the op on local shards and wraps the results.

An op without a rule falls back to: gather every input to Replicate, run on full
tensors, return Replicate. That is always correct; it warns once per op and
counts in :func:`fallback_counts`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.dtensor._api import DTensor
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement, Replicate

__all__ = [
    "Decision",
    "FallbackWarning",
    "OpCall",
    "fallback_counts",
    "implicit_replication",
    "register_rule",
    "register_special",
]

aten = torch.ops.aten

Placements = tuple[Placement, ...]


class FallbackWarning(UserWarning):
    """An op ran through the gather-compute-replicate fallback (correct, but slow)."""


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
    rewrite: Callable[[tuple[Any, ...], dict[str, Any], list[tuple[int, ...] | None]], tuple[tuple[Any, ...], dict[str, Any]]] | None = None


Rule = Callable[[OpCall], Decision]
Special = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any]

_RULES: dict[Any, Rule] = {}
_TAG_RULES: dict[Any, Rule] = {}
_SPECIALS: dict[Any, Special] = {}


def register_rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a sharding rule for op overloads (or whole overload packets)."""

    def deco(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return deco


def register_special(*ops: Any) -> Callable[[Special], Special]:
    """Register a handler that takes the whole call (for ops that are not shard-local)."""

    def deco(handler: Special) -> Special:
        for op in ops:
            _SPECIALS[op] = handler
        return handler

    return deco


def register_tag_rule(tag: Any, rule: Rule) -> None:
    """Register the rule of every op carrying ``tag`` (e.g. ``torch.Tag.pointwise``)."""
    _TAG_RULES[tag] = rule


def rule_for(func: torch._ops.OpOverload) -> Rule | None:
    """The rule of an op overload, of its overload packet, or of one of its tags."""
    rule = _RULES.get(func)
    if rule is None:
        rule = _RULES.get(func.overloadpacket)
    if rule is None:
        for tag in func.tags:
            rule = _TAG_RULES.get(tag)
            if rule is not None:
                break
    return rule


_fallbacks: Counter[str] = Counter()


def fallback_counts() -> dict[str, int]:
    """How many times each op has fallen back since the process started (or the last reset).

    Example::

        before = fallback_counts()
    """
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    """Forget the fallback counts."""
    _fallbacks.clear()


_implicit_replication: ContextVar[bool] = ContextVar("hp_implicit_replication", default=False)


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors mixed with DTensors in one op as replicated on the DTensors' mesh.

    Example::

        with implicit_replication():
            y = dt + torch.ones(4)   # the plain tensor acts as Replicate()
    """
    token = _implicit_replication.set(True)
    try:
        yield
    finally:
        _implicit_replication.reset(token)


@dataclass(slots=True)
class _Plan:
    targets: list[Placements]
    out_specs: list[DTensorSpec | None]
    local_fn: LocalFn | None
    rewrite: Any
    inplace: bool
    fallback: bool
    out_local_shapes: list[tuple[int, ...] | None] = field(default_factory=list)


_MAX_CACHE = 8192
_plans: dict[Any, _Plan] = {}


def clear_plan_cache() -> None:
    """Forget every cached sharding decision."""
    _plans.clear()


def plan_cache_size() -> int:
    """Number of cached sharding decisions."""
    return len(_plans)


class _MixedTensorError(TypeError):
    pass


def _key_of(
    value: Any, specs: list[DTensorSpec], dtensors: list[DTensor], func: Any, where: str
) -> Any:
    if isinstance(value, DTensor):
        specs.append(value._spec)
        dtensors.append(value)
        return value._spec
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            return ("scalar", value.dtype, value.device)
        raise _MixedTensorError(where)
    if isinstance(value, (list, tuple)):
        return tuple(_key_of(v, specs, dtensors, func, f"{where}[{i}]") for i, v in enumerate(value))
    return value


def _promote_plain(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Wrap plain (non-scalar) tensors as Replicate DTensors on the mesh of the first DTensor."""
    mesh: DeviceMesh | None = None

    def find(v: Any) -> None:
        nonlocal mesh
        if mesh is None:
            if isinstance(v, DTensor):
                mesh = v._spec.mesh
            elif isinstance(v, (list, tuple)):
                for e in v:
                    find(e)

    for a in (*args, *kwargs.values()):
        find(a)
    assert mesh is not None

    def wrap(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            from hyper_parallel.dtensor._api import contiguous_strides

            meta = TensorMeta(v.shape, contiguous_strides(v.shape), v.dtype)
            return DTensor(v, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))  # type: ignore[arg-type]
        if isinstance(v, (list, tuple)):
            return type(v)(wrap(e) for e in v)
        return v

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


def dispatch(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DTensor arguments (the body of ``DTensor.__torch_dispatch__``)."""
    special = _SPECIALS.get(func)
    if special is not None:
        return special(func, args, kwargs)
    return dispatch_by_rules(func, args, kwargs)


def dispatch_by_rules(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``func`` through its sharding rule (or the fallback), bypassing special handlers."""
    specs: list[DTensorSpec] = []
    dtensors: list[DTensor] = []
    try:
        key = (
            func,
            tuple(_key_of(a, specs, dtensors, func, f"argument {i}") for i, a in enumerate(args)),
            tuple((k, _key_of(v, specs, dtensors, func, f"argument {k!r}")) for k, v in kwargs.items()),
        )
    except _MixedTensorError as exc:
        if _implicit_replication.get():
            args, kwargs = _promote_plain(args, kwargs)
            return dispatch(func, args, kwargs)
        raise TypeError(
            f"{func}: {exc} is a plain torch.Tensor while other arguments are DTensors. Wrap it "
            "with DTensor.from_local(...) or distribute_tensor(...), or run the op under "
            "hyper_parallel.dtensor.implicit_replication() to treat it as Replicate()"
        ) from None
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument: plan without caching
        key = None
        plan = None
    if plan is None:
        plan = _make_plan(func, args, kwargs, specs)
        if key is not None:
            if len(_plans) >= _MAX_CACHE:
                _plans.clear()
            _plans[key] = plan
    if plan.fallback:
        return _run_fallback(func, args, kwargs, dtensors, plan)
    return _run_plan(func, args, kwargs, dtensors, plan)


def _meta_like(spec: DTensorSpec) -> torch.Tensor:
    meta = spec.tensor_meta
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")


def _swap(value: Any, it: Iterator[Any]) -> Any:
    if isinstance(value, DTensor):
        return next(it)
    if isinstance(value, (list, tuple)) and any(isinstance(v, (DTensor, list, tuple)) for v in value):
        return type(value)(_swap(v, it) for v in value)
    return value


def _swap_all(args: tuple[Any, ...], kwargs: dict[str, Any], replacements: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
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


def _is_inplace(func: torch._ops.OpOverload) -> bool:
    schema = func._schema
    if not schema.arguments:
        return False
    first = schema.arguments[0].alias_info
    return bool(first is not None and first.is_write) and func._schema.name.endswith("_")


def _make_plan(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[DTensorSpec]
) -> _Plan:
    rule = rule_for(func)
    inplace = _is_inplace(func)
    if rule is None:
        return _Plan([], [], None, None, inplace, True)
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(f"{func}: DTensor arguments live on different meshes: {mesh} and {s.mesh}")
    meta_args, meta_kwargs = _swap_all(args, kwargs, [_meta_like(s) for s in specs])
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")
    if meta_kwargs.get("pin_memory"):
        meta_kwargs["pin_memory"] = False
    try:
        meta_out = func(*meta_args, **meta_kwargs)
    except (NotImplementedError, RuntimeError):
        return _Plan([], [], None, None, inplace, True)
    out_flat = _flatten_outputs(meta_out)
    out_metas: list[TensorMeta | None] = [
        TensorMeta(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else None for o in out_flat
    ]
    spec_args, spec_kwargs = _swap_all(args, kwargs, specs)
    call = OpCall(func, spec_args, spec_kwargs, specs, mesh, out_metas)
    decision = rule(call)
    if decision is None:  # the rule declines: this call falls back
        return _Plan([], [], None, None, inplace, True)
    out_specs: list[DTensorSpec | None] = []
    out_local_shapes: list[tuple[int, ...] | None] = []
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    from hyper_parallel.dtensor._spec import local_shape_and_offset

    for meta, placements in zip(out_metas, decision.outputs):
        if meta is None or placements is None:
            out_specs.append(None)
            out_local_shapes.append(None)
        else:
            out_specs.append(DTensorSpec(mesh, placements, meta))
            shape, _ = local_shape_and_offset(meta.shape, mesh.shape, coordinate, placements)
            out_local_shapes.append(shape)
    return _Plan(
        list(decision.inputs), out_specs, decision.local_fn, decision.rewrite, inplace, False, out_local_shapes
    )


def _run_plan(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
    plan: _Plan,
) -> Any:
    locals_: list[torch.Tensor] = []
    for dt, target in zip(dtensors, plan.targets):
        spec = dt._spec
        if spec.placements == target:
            locals_.append(dt._local_tensor)
        else:
            locals_.append(redistribute_local(dt._local_tensor, spec, target))
    if plan.inplace and locals_ and locals_[0] is not dtensors[0]._local_tensor:
        # the op mutates a tensor whose layout must change first: the value stays, the layout moves
        self_dt = dtensors[0]
        self_dt._local_tensor = locals_[0]
        self_dt._spec = self_dt._spec.with_placements(plan.targets[0])
    local_args, local_kwargs = _swap_all(args, kwargs, locals_)
    if plan.rewrite is not None:
        local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.out_local_shapes)
    fn = plan.local_fn or func
    out = fn(*local_args, **local_kwargs)
    if plan.inplace:
        return dtensors[0]
    return _wrap(out, iter(plan.out_specs))


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


def _run_fallback(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
    plan: _Plan,
) -> Any:
    name = str(func)
    _fallbacks[name] += 1
    if _fallbacks[name] == 1:
        warnings.warn(
            f"hyper_parallel.dtensor: {name} has no sharding rule; it ran on full tensors "
            "(gathered to Replicate) and returned Replicate. Correct, but it communicates and "
            "computes the whole tensor on every rank.",
            FallbackWarning,
            stacklevel=3,
        )
    if not dtensors:
        return func(*args, **kwargs)
    mesh = dtensors[0]._spec.mesh
    replicate = (Replicate(),) * mesh.ndim
    fulls = [redistribute_local(dt._local_tensor, dt._spec, replicate) for dt in dtensors]
    full_args, full_kwargs = _swap_all(args, kwargs, fulls)
    out = func(*full_args, **full_kwargs)
    if plan.inplace:
        self_dt = dtensors[0]
        spec = self_dt._spec
        if spec.has_partial():
            self_dt._local_tensor = fulls[0]
            self_dt._spec = spec.with_placements(replicate)
        elif not spec.is_replicated():
            from hyper_parallel.dtensor._api import _local_slice

            coordinate = mesh.get_coordinate() or [0] * mesh.ndim
            self_dt._local_tensor.copy_(_local_slice(fulls[0], mesh, coordinate, spec.placements))
        return self_dt
    return _wrap_replicated(out, mesh)


def _wrap_replicated(out: Any, mesh: DeviceMesh) -> Any:
    if isinstance(out, torch.Tensor):
        meta = TensorMeta(out.shape, out.stride(), out.dtype)
        return DTensor(out, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(o, mesh) for o in out)
    return out


DTensor._dispatch_hook = staticmethod(dispatch)

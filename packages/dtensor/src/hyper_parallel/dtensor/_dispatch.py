"""Running torch ops on DTensors: the body of ``DTensor.__torch_dispatch__``.

For each call the dispatcher builds a cache key from the argument specs, looks up
the op's plan (deriving it on a miss, see ``_planning``), redistributes the inputs
the plan names, runs the op (or the rule's local function) on local shards and
wraps the results with the planned specs. Ops without a usable rule take the
fallback (``_fallback``): correct, warned about and counted. Plain tensors mixed
with DTensors are an error, unless under :func:`implicit_replication`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from hyper_parallel.dtensor._api import DTensor, contiguous_strides
from hyper_parallel.dtensor._fallback import (
    FallbackWarning,
    _run_fallback,
    fallback_counts,
    reset_fallback_counts,
)
from hyper_parallel.dtensor._planning import (
    _MAX_PLANS_PER_OP,
    _OPS,
    _WRAP,
    Decision,
    OpCall,
    _aliased_result,
    _make_plan,
    _op_info,
    _swap_all,
    _wrap,
    clear_plan_cache,
    plan_cache_size,
    plan_derivations,
    register_rule,
    register_special,
    register_tag_rule,
    rule_for,
)
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Replicate

__all__ = [
    "Decision",
    "FallbackWarning",
    "OpCall",
    "clear_plan_cache",
    "dispatch",
    "dispatch_by_rules",
    "fallback_counts",
    "implicit_replication",
    "plan_cache_size",
    "plan_derivations",
    "register_rule",
    "register_special",
    "register_tag_rule",
    "reset_fallback_counts",
    "rule_for",
]

aten = torch.ops.aten


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


class _MixedTensorError(TypeError):
    pass


_TRUE = ("bool", True)


_FALSE = ("bool", False)


def _seq_key(value: Sequence[Any], dtensors: list[DTensor], floats_by_type: bool) -> Any:
    """Cache key of a list/tuple argument; collects the DTensors in it (in order)."""
    parts: list[Any] = []
    for v in value:
        if isinstance(v, DTensor):
            dtensors.append(v)
            parts.append(v._spec)
        elif isinstance(v, torch.Tensor):
            if v.ndim:
                raise _MixedTensorError
            parts.append((v.dtype, v.device))
        elif isinstance(v, (list, tuple)):
            parts.append(_seq_key(v, dtensors, floats_by_type))
        elif type(v) is float:
            parts.append(float if floats_by_type else (float, v))
        elif type(v) is bool:
            parts.append(_TRUE if v else _FALSE)
        else:
            parts.append(v)
    return tuple(parts)


def dispatch_by_rules(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``func`` through its sharding rule (or the fallback), bypassing special handlers.

    Example::

        dispatch_by_rules(torch.ops.aten.copy_.default, (dst, src), {})
    """
    return dispatch(func, args, kwargs, _specials=False)


def dispatch(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    _specials: bool = True,
) -> Any:
    """Run ``func`` on DTensor arguments (the body of ``DTensor.__torch_dispatch__``).

    This is the hot path of every op: one function, no per-call derivation.

    Example::

        dispatch(torch.ops.aten.add.Tensor, (dt, dt), {})  # what dt + dt runs
    """
    info = _OPS.get(id(func)) or _op_info(func)
    if _specials and info.special is not None:
        return info.special(func, args, kwargs)
    dtensors: list[DTensor] = []
    key: list[Any] = []
    flat_locals: list[Any] = []
    flat = True  # no DTensor inside a list or in kwargs: flat_locals is the local call
    by_type = info.floats_by_type
    try:
        for a in args:
            if isinstance(a, DTensor):
                dtensors.append(a)
                key.append(a._spec)
                flat_locals.append(a._local_tensor)
                continue
            flat_locals.append(a)
            if type(a) is list and a and type(a[0]) is int:  # int[] (schema lists are homogeneous)
                key.append(tuple(a))
            elif isinstance(a, (list, tuple)):
                n = len(dtensors)
                key.append(_seq_key(a, dtensors, by_type))
                if len(dtensors) != n:
                    flat = False
            elif isinstance(a, torch.Tensor):
                if a.ndim:
                    raise _MixedTensorError
                key.append((a.dtype, a.device))
            elif type(a) is float:
                key.append(float if by_type else (float, a))
            elif type(a) is bool:
                key.append(_TRUE if a else _FALSE)
            else:
                key.append(a)
        if kwargs:
            for name, v in kwargs.items():
                key.append(name)
                n = len(dtensors)
                key.append(_seq_key((v,), dtensors, by_type))
                if len(dtensors) != n:
                    flat = False
    except _MixedTensorError:
        return _mixed(func, args, kwargs)
    key_t: tuple[Any, ...] | None = tuple(key)
    try:
        plan = info.plans.get(key_t)
    except TypeError:  # an unhashable argument: plan without caching
        key_t = None
        plan = None
    if plan is None:
        plan = _make_plan(info, args, kwargs, dtensors)
        if key_t is not None:
            if len(info.plans) >= _MAX_PLANS_PER_OP:
                info.plans.clear()
            info.plans[key_t] = plan
    if plan.fallback:
        return _run_fallback(info, plan, args, kwargs, dtensors)

    local_args: Sequence[Any]
    local_kwargs: dict[str, Any]
    if plan.moves:
        locals_ = [dt._local_tensor for dt in dtensors]
        for i, target in plan.moves:
            dt = dtensors[i]
            locals_[i] = redistribute_local(locals_[i], dt._spec, target)
        for i in plan.mutated:
            moved = plan.moved_specs[i]
            if moved is not None:  # the op writes a tensor whose layout changes first
                dt = dtensors[i]
                dt._local_tensor = locals_[i]
                dt._spec = moved
        local_args, local_kwargs = _swap_all(args, kwargs, locals_)
    elif flat:
        local_args, local_kwargs = flat_locals, kwargs
    else:
        local_args, local_kwargs = _swap_all(args, kwargs, [dt._local_tensor for dt in dtensors])
    if plan.rewrite is not None:
        local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.out_local_shapes)
    out = plan.fn(*local_args, **local_kwargs)
    single = plan.single
    if single is not None:
        return DTensor(out, single)
    if plan.result == _WRAP:
        return _wrap(out, iter(plan.out_specs))
    for i, spec in plan.relabel:
        dtensors[i]._spec = spec
    return _aliased_result(plan, out, dtensors)


# Ops whose plain-tensor arguments autograd itself creates in backward formulas (e.g.
# ``index_put(grad, indices, zeros(values.shape))``): they are taken as Replicate.
_AUTOGRAD_MIXES = {aten.index_put.default}


def _mixed(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _implicit_replication.get() or func in _AUTOGRAD_MIXES:
        args, kwargs = _promote_plain(args, kwargs)
        return dispatch(func, args, kwargs)
    names = [a.name for a in func._schema.arguments]
    where = "an argument"
    for i, a in enumerate(args):
        if _has_plain(a):
            where = f"argument {i} ({names[i]!r})" if i < len(names) else f"argument {i}"
            break
    else:
        for k, v in kwargs.items():
            if _has_plain(v):
                where = f"argument {k!r}"
                break
    # RuntimeError, not TypeError: Python operators (``dt + t``) turn a TypeError into
    # "unsupported operand type(s)", hiding this message.
    raise RuntimeError(
        f"{func}: {where} is a plain torch.Tensor while other arguments are DTensors. Wrap it "
        "with DTensor.from_local(...) or distribute_tensor(...), or run the op under "
        "hyper_parallel.dtensor.implicit_replication() to treat it as Replicate()"
    )


def _has_plain(v: Any) -> bool:
    if isinstance(v, DTensor):
        return False
    if isinstance(v, torch.Tensor):
        return v.ndim > 0
    if isinstance(v, (list, tuple)):
        return any(_has_plain(e) for e in v)
    return False


def _promote_plain(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
            meta = TensorMeta(v.shape, contiguous_strides(v.shape), v.dtype)
            return DTensor(v, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))  # type: ignore[union-attr]
        if isinstance(v, (list, tuple)):
            return type(v)(wrap(e) for e in v)
        return v

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


DTensor._dispatch_hook = staticmethod(dispatch)

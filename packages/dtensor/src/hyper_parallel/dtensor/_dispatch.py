"""Running torch ops on DTensors: the body of ``DTensor.__torch_dispatch__``.

For each call the dispatcher builds a cache key from the argument specs and looks the
op's plan up in its cache; on a miss planning derives it (``_planning.derive_plan``),
and ``_planning.run_plan`` runs it. Ops with a whole-call handler (``_registry``'s
specials) go to it. Plain tensors mixed with DTensors are an error, unless under
:func:`implicit_replication`.

The DTensor class imports this module and passes itself in (``tensor_type``): nothing
here imports the class, so imports flow one way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor import _registry
from hyper_parallel.dtensor._planning import derive_plan, op_info, run_plan
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, contiguous_strides, replicate_all
from hyper_parallel.dtensor.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor

__all__ = ["dispatch", "dispatch_by_rules", "implicit_replication"]

TensorType = type["DTensor"]

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


def _seq_key(
    tensor_type: TensorType, value: Sequence[Any], dtensors: list[DTensor], floats_by_type: bool
) -> Any:
    """Cache key of a list/tuple argument; collects the DTensors in it (in order)."""
    parts: list[Any] = []
    for v in value:
        if isinstance(v, tensor_type):
            dtensors.append(v)
            parts.append(v._spec)
        elif isinstance(v, torch.Tensor):
            if v.ndim:
                raise _MixedTensorError
            parts.append((v.dtype, v.device))
        elif isinstance(v, (list, tuple)):
            parts.append(_seq_key(tensor_type, v, dtensors, floats_by_type))
        elif type(v) is float:
            parts.append(float if floats_by_type else (float, v))
        elif type(v) is bool:
            parts.append(_TRUE if v else _FALSE)
        else:
            parts.append(v)
    return tuple(parts)


def dispatch_by_rules(
    tensor_type: TensorType,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``func`` through its sharding rule (or the fallback), bypassing special handlers.

    Example::

        dispatch_by_rules(DTensor, torch.ops.aten.copy_.default, (dst, src), {})
    """
    return dispatch(tensor_type, func, args, kwargs, _specials=False)


def dispatch(
    tensor_type: TensorType,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    _specials: bool = True,
) -> Any:
    """Run ``func`` on DTensor arguments (the body of ``DTensor.__torch_dispatch__``).

    This is the hot path of every op: one key, one lookup, no per-call derivation.

    Example::

        dispatch(DTensor, torch.ops.aten.add.Tensor, (dt, dt), {})  # what dt + dt runs
    """
    info = _registry.derived.get(id(func)) or op_info(func)
    if _specials and info.special is not None:
        return info.special(func, args, kwargs)
    dtensors: list[DTensor] = []
    key: list[Any] = []
    flat_locals: list[Any] = []
    flat = True  # no DTensor inside a list or in kwargs: flat_locals is the local call
    by_type = info.floats_by_type
    try:
        for a in args:
            if isinstance(a, tensor_type):
                dtensors.append(a)
                key.append(a._spec)
                flat_locals.append(a._local_tensor)
                continue
            flat_locals.append(a)
            if type(a) is list and a and type(a[0]) is int:  # int[] (schema lists are homogeneous)
                key.append(tuple(a))
            elif isinstance(a, (list, tuple)):
                n = len(dtensors)
                key.append(_seq_key(tensor_type, a, dtensors, by_type))
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
                key.append(_seq_key(tensor_type, (v,), dtensors, by_type))
                if len(dtensors) != n:
                    flat = False
    except _MixedTensorError:
        return _mixed(tensor_type, func, args, kwargs)
    key_t: tuple[Any, ...] | None = tuple(key)
    try:
        plan = info.plans.get(key_t)
    except TypeError:  # an unhashable argument: plan without caching
        key_t = None
        plan = None
    if plan is None:
        plan = derive_plan(tensor_type, info, key_t, args, kwargs, dtensors)
    return run_plan(tensor_type, plan, args, kwargs, dtensors, flat_locals if flat else None)


# Ops whose plain-tensor arguments autograd itself creates in backward formulas (e.g.
# ``index_put(grad, indices, zeros(values.shape))``): they are taken as Replicate.
_AUTOGRAD_MIXES = {aten.index_put.default}


def _mixed(
    tensor_type: TensorType,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if (
        _implicit_replication.get()
        or func in _AUTOGRAD_MIXES
        or _only_one_element_plain(tensor_type, args, kwargs)
    ):
        args, kwargs = _promote_plain(tensor_type, args, kwargs)
        return dispatch(tensor_type, func, args, kwargs)
    names = [a.name for a in func._schema.arguments]
    where = "an argument"
    for i, a in enumerate(args):
        if _has_plain(tensor_type, a):
            where = f"argument {i} ({names[i]!r})" if i < len(names) else f"argument {i}"
            break
    else:
        for k, v in kwargs.items():
            if _has_plain(tensor_type, v):
                where = f"argument {k!r}"
                break
    # RuntimeError, not TypeError: Python operators (``dt + t``) turn a TypeError into
    # "unsupported operand type(s)", hiding this message.
    raise RuntimeError(
        f"{func}: {where} is a plain torch.Tensor while other arguments are DTensors. Wrap it "
        "with DTensor.from_local(...) or distribute_tensor(...), or run the op under "
        "hyper_parallel.dtensor.implicit_replication() to treat it as Replicate()"
    )


def _only_one_element_plain(
    tensor_type: TensorType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """True when every plain tensor argument holds one element: torch replicates those."""

    def ok(v: Any) -> bool:
        if isinstance(v, tensor_type):
            return True
        if isinstance(v, torch.Tensor):
            return v.numel() == 1
        if isinstance(v, (list, tuple)):
            return all(ok(e) for e in v)
        return True

    return all(ok(a) for a in args) and all(ok(v) for v in kwargs.values())


def _has_plain(tensor_type: TensorType, v: Any) -> bool:
    if isinstance(v, tensor_type):
        return False
    if isinstance(v, torch.Tensor):
        return v.ndim > 0
    if isinstance(v, (list, tuple)):
        return any(_has_plain(tensor_type, e) for e in v)
    return False


def _promote_plain(
    tensor_type: TensorType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Wrap plain (non-scalar) tensors as Replicate DTensors on the mesh of the first DTensor."""
    mesh: DeviceMesh | None = None

    def find(v: Any) -> None:
        nonlocal mesh
        if mesh is None:
            if isinstance(v, tensor_type):
                mesh = v._spec.mesh
            elif isinstance(v, (list, tuple)):
                for e in v:
                    find(e)

    for a in (*args, *kwargs.values()):
        find(a)
    assert mesh is not None

    def wrap(v: Any) -> Any:
        if isinstance(v, tensor_type):
            return v
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            meta = TensorMeta(v.shape, contiguous_strides(v.shape), v.dtype)
            return tensor_type(v, DTensorSpec(mesh, replicate_all(mesh.ndim), meta))  # type: ignore[union-attr]
        if isinstance(v, (list, tuple)):
            return type(v)(wrap(e) for e in v)
        return v

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

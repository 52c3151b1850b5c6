"""Running torch ops on DTensors: the dispatcher that ``DTensor.__torch_dispatch__`` calls.

One :class:`Dispatcher` per DTensor class (the class holds it as ``_op_dispatcher``, as
torch's DTensor holds its ``OpDispatcher``) owns what dispatch derives: per op its
:class:`~hyper_parallel.dtensor._plan.OpInfo` (rule, special, schema facts) and its
plan cache. It holds the rule registry and forgets what it derived whenever a rule is
registered.

For each call it builds a cache key from the argument specs and looks the op's plan up;
on a miss it derives the plan (``_planning``), then runs it. Ops with a whole-call
handler (``_registry``'s specials) go to it. Plain tensors mixed with DTensors are an
error, unless under :func:`implicit_replication`.

The dispatcher is built for the DTensor class and holds it: nothing here imports the
class, so imports flow one way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor._planning import OpInfo, Plan, Planner, derive_op_info
from hyper_parallel.dtensor._registry import RuleRegistry, registry
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, contiguous_strides, replicate_all
from hyper_parallel.dtensor.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor

__all__ = ["Dispatcher", "detach_alias", "implicit_replication"]

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


# Booleans key as tagged pairs: True == 1 and hash(True) == hash(1), so a bare bool
# would share its cache entry (and plan, with its output dtype) with the int 1.
_TRUE = ("bool", True)
_FALSE = ("bool", False)

# Argument types that key as themselves (``key``'s last case), checked by exact type.
_AS_IS: frozenset[type] = frozenset(
    {int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)

# Ops whose plain-tensor arguments autograd itself creates in backward formulas (e.g.
# ``index_put(grad, indices, zeros(values.shape))``): they are taken as Replicate.
_AUTOGRAD_MIXES = {aten.index_put.default}


def _flat(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """Every argument, lists flattened, in dispatch order."""
    out: list[Any] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            out.extend(_flat(v, {}))
        else:
            out.append(v)
    return out


_DETACH = aten.detach.default

_make_wrapper = torch.Tensor._make_wrapper_subclass

# the attribute of an op (OpOverload) that holds its OpInfo (see Dispatcher.op_info)
_INFO_ATTR = "_hp_op_info"

# bound on an op's fast-path entries (cleared when full, as the plan cache is)
_MAX_FAST_PER_OP = 1024


def detach_alias(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``aten.detach`` of a DTensor: its local shard detached, with the same spec (an alias).

    The registered special of ``aten.detach.default``; the dispatcher runs it inline
    while it is the registered one.

    Example::

        detach_alias(torch.ops.aten.detach.default, (dt,), {})   # what dt.detach() returns
    """
    x = args[0]
    return type(x)(x._local_tensor.detach(), x._spec)


class Dispatcher(Planner):
    """Dispatches torch ops on DTensors of one class: keys, caches and runs their plans.

    Example::

        DTensor._op_dispatcher.dispatch(torch.ops.aten.add.Tensor, (dt, dt), {})  # dt + dt
    """

    def __init__(self, tensor_type: TensorType, rules: RuleRegistry = registry) -> None:
        super().__init__(tensor_type)
        self.registry = rules
        self._infos: dict[int, OpInfo] = {}  # by id(op): the ops this dispatcher has seen
        self._inline_detach: bool | None = None  # detach_alias is detach's special (None: unknown)
        # the class builds its wrappers with the plain constructor (``_tensor`` marks it):
        # the fast path builds them inline
        self._inline_wrap = bool(getattr(tensor_type.__new__, "_hp_plain_wrapper", False))
        rules.watch(self._rules_changed)
        # The class's __torch_dispatch__ is the dispatch body itself (one Python frame per
        # op), reading the class's dispatcher; this one is it from now on.
        tensor_type._op_dispatcher = self
        setattr(tensor_type, "__torch_dispatch__", classmethod(torch_dispatch))  # noqa: B010

    def _rules_changed(self) -> None:
        for info in self._infos.values():  # the ops forget this dispatcher's derivations
            if getattr(info.func, _INFO_ATTR, None) is info:
                setattr(info.func, _INFO_ATTR, None)
        self._infos.clear()
        self._inline_detach = None

    # -- the plan cache ----------------------------------------------------------------

    def op_info(self, func: torch._ops.OpOverload) -> OpInfo:
        """The planning state of ``func`` (derived on first use, again after a registration).

        Example::

            DTensor._op_dispatcher.op_info(torch.ops.aten.mm.default).rule  # the mm rule
        """
        info = self._infos.get(id(func))
        if info is None:
            info = self._infos[id(func)] = derive_op_info(func, self.registry)
            info.owner = self
        # the op object carries the info of the dispatcher that last asked (the hot path
        # reads it there: no id() and no lookup per call); a class's own dispatcher
        # checks the owner
        with suppress(AttributeError):
            setattr(func, _INFO_ATTR, info)
        return info

    def clear_plan_cache(self) -> None:
        """Forget every cached sharding decision."""
        for info in self._infos.values():
            info.plans.clear()
            info.fast.clear()
        self._specs.clear()

    def plan_cache_size(self) -> int:
        """Number of cached sharding decisions."""
        return sum(len(info.plans) for info in self._infos.values())

    # -- dispatch ----------------------------------------------------------------------

    def dispatch(
        self,
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        specials: bool = True,
    ) -> Any:
        """Run ``func`` on DTensor arguments (what ``DTensor.__torch_dispatch__`` runs).

        ``specials=False`` bypasses the op's whole-call handler (a special that hands
        the call back to the op's rule).

        Example::

            DTensor._op_dispatcher.dispatch(torch.ops.aten.add.Tensor, (dt, dt), {})
        """
        return torch_dispatch(self.tensor_type, func, (), args, kwargs, specials, self)

    def plan_for(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Plan | None:
        """The plan a call would run, without running it (``None``: a special takes the call).

        Example::

            DTensor._op_dispatcher.plan_for(torch.ops.aten.mm.default, (x, w), {}).moves
        """
        info = self.op_info(func)
        if info.special is not None:
            return None
        dtensors = [a for a in _flat(args, kwargs) if isinstance(a, self.tensor_type)]
        try:
            key = self.cache_key(func, args, kwargs)
        except _MixedTensorError:
            raise RuntimeError(
                f"{func}: a plain torch.Tensor among DTensor arguments; wrap it as a DTensor"
            ) from None
        try:
            plan = info.plans.get(key)
        except TypeError:
            return self.derive_plan(info, None, args, kwargs, dtensors)
        return plan or self.derive_plan(info, key, args, kwargs, dtensors)

    def dispatch_by_rules(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``func`` through its sharding rule (or the fallback), bypassing its special.

        Example::

            DTensor._op_dispatcher.dispatch_by_rules(torch.ops.aten.copy_.default, (dst, src), {})
        """
        return self.dispatch(func, args, kwargs, specials=False)

    def key(
        self, values: Sequence[Any], dtensors: list[DTensor], floats_by_type: bool
    ) -> tuple[Any, ...]:
        """The cache key of a sequence of arguments; collects the DTensors in it (in order).

        Each DTensor contributes its spec, a scalar tensor its dtype and device, a float
        its type only where the op's rule ignores float values, anything else its value.
        A plain tensor of rank > 0 raises ``_MixedTensorError``.

        Example::

            DTensor._op_dispatcher.key((dt, 2), [], False)  # (dt._spec, 2)
        """
        tensor_type = self.tensor_type
        parts: list[Any] = []
        for v in values:
            if isinstance(v, tensor_type):
                dtensors.append(v)
                parts.append(v._spec)
            elif (
                type(v) is list and v and type(v[0]) is int
            ):  # int[] (schema lists are homogeneous)
                parts.append(tuple(v))
            elif isinstance(v, (list, tuple)):
                parts.append(self.key(v, dtensors, floats_by_type))
            elif isinstance(v, torch.Tensor):
                if v.ndim:
                    raise _MixedTensorError
                parts.append((v.dtype, v.device))
            elif type(v) is float:
                parts.append(float if floats_by_type else (float, v))
            elif type(v) is bool:
                parts.append(_TRUE if v else _FALSE)
            else:
                parts.append(v)
        return tuple(parts)

    def cache_key(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...]:
        """The key under which a call's plan is cached (what ``dispatch`` computes inline).

        Example::

            DTensor._op_dispatcher.cache_key(torch.ops.aten.add.Tensor, (dt, dt), {})
        """
        by_type = self.op_info(func).floats_by_type
        key = self.key(args, [], by_type)
        if kwargs:
            key = (*key, *self.key(tuple(kwargs.items()), [], by_type))
        return key

    # -- plain tensors among DTensors --------------------------------------------------

    def _mixed(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if (
            _implicit_replication.get()
            or func in _AUTOGRAD_MIXES
            or self._only_one_element_plain(args, kwargs)
        ):
            args, kwargs = self._promote_plain(args, kwargs)
            return self.dispatch(func, args, kwargs)
        names = [a.name for a in func._schema.arguments]
        where = "an argument"
        for i, a in enumerate(args):
            if self._has_plain(a):
                where = f"argument {i} ({names[i]!r})" if i < len(names) else f"argument {i}"
                break
        else:
            for k, v in kwargs.items():
                if self._has_plain(v):
                    where = f"argument {k!r}"
                    break
        # RuntimeError, not TypeError: Python operators (``dt + t``) turn a TypeError into
        # "unsupported operand type(s)", hiding this message.
        raise RuntimeError(
            f"{func}: {where} is a plain torch.Tensor while other arguments are DTensors. Wrap "
            "it with DTensor.from_local(...) or distribute_tensor(...), or run the op under "
            "hyper_parallel.dtensor.implicit_replication() to treat it as Replicate()"
        )

    def _only_one_element_plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when every plain tensor argument holds one element: torch replicates those."""
        tensor_type = self.tensor_type

        def ok(v: Any) -> bool:
            if isinstance(v, tensor_type):
                return True
            if isinstance(v, torch.Tensor):
                return v.numel() == 1
            if isinstance(v, (list, tuple)):
                return all(ok(e) for e in v)
            return True

        return all(ok(a) for a in args) and all(ok(v) for v in kwargs.values())

    def _has_plain(self, v: Any) -> bool:
        if isinstance(v, self.tensor_type):
            return False
        if isinstance(v, torch.Tensor):
            return v.ndim > 0
        if isinstance(v, (list, tuple)):
            return any(self._has_plain(e) for e in v)
        return False

    def _promote_plain(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Wrap plain (non-scalar) tensors as Replicate DTensors on the mesh of the first DTensor."""
        tensor_type = self.tensor_type
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
                return tensor_type(v, DTensorSpec(mesh, replicate_all(mesh.ndim), meta))  # type: ignore[arg-type]
            if isinstance(v, (list, tuple)):
                return type(v)(wrap(e) for e in v)
            return v

        return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


def torch_dispatch(
    cls: type,
    func: torch._ops.OpOverload,
    types: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    specials: bool = True,
    self: Dispatcher | None = None,
) -> Any:
    """A DTensor class's ``__torch_dispatch__`` (a :class:`Dispatcher` installs it on the class
    it is built for): run ``func`` with ``self``, by default the class's dispatcher.

    This is the hot path of every op: one key, one lookup, no per-call derivation.
    ``specials=False`` bypasses the op's whole-call handler.

    Example::

        DTensor.__torch_dispatch__(torch.ops.aten.add.Tensor, (DTensor,), (dt, dt), {})
    """
    if self is None:
        self = cls._op_dispatcher  # type: ignore[attr-defined]
    if kwargs is None:
        kwargs = {}
    tensor_type = self.tensor_type
    if func is _DETACH and specials:
        inline = self._inline_detach
        if inline is None:
            inline = self._inline_detach = self.registry.special_for(func) is detach_alias
        if inline and not kwargs and type(args[0]) is tensor_type:
            x = args[0]  # detach_alias, inline
            return tensor_type(x._local_tensor.detach(), x._spec)
    try:
        info = func._hp_op_info  # type: ignore[attr-defined]
    except AttributeError:
        info = None
    if info is None or info.owner is not self:
        info = self.op_info(func)
    if specials and info.special is not None:
        return info.special(func, args, kwargs)
    fast_ok = False
    # The fast path of a cache hit: positional arguments that are DTensors of this
    # class or scalars, and scalar keyword arguments, key as ``key`` keys them, but
    # each DTensor by its spec's ``_key`` (hashed in C: the spec's own ``__hash__`` is a
    # Python call), built without a call per argument (a DTensor train step spends
    # most of its Python calls in dispatch). A hit is used only when its specs equal the arguments'
    # (identical objects compare without a call). Anything else, and a miss, take the
    # general path below, which files its plan here too. test_dispatcher checks both
    # paths agree (the same key, the same result).
    fast_key: tuple[Any, ...] = ()
    fast_specs: tuple[Any, ...] = ()
    fast_dts: tuple[Any, ...] = ()
    fast_locals: tuple[Any, ...] = ()
    for a in args:
        t = type(a)
        if t is tensor_type:
            spec = a._spec
            fast_key += (spec._key,)
            fast_specs += (spec,)
            fast_dts += (a,)
            fast_locals += (a._local_tensor,)
            continue
        if t in _AS_IS:
            fast_key += (a,)
        elif t is float:
            fast_key += (float if info.floats_by_type else (float, a),)
        elif t is bool:
            fast_key += (_TRUE if a else _FALSE,)
        elif t is list and a and type(a[0]) is int:
            fast_key += (tuple(a),)
        elif t is list and a and type(a[0]) is tensor_type:
            # a list of DTensors (a foreach op's: an optimizer's states), keyed and
            # its locals collected without a call per tensor
            part: tuple[Any, ...] = ()
            local_list: list[Any] = []
            for e in a:
                if type(e) is not tensor_type:
                    break
                spec = e._spec
                part += (spec._key,)
                fast_specs += (spec,)
                local_list += (e._local_tensor,)
            else:
                fast_key += (part,)
                fast_dts += tuple(a)
                fast_locals += (local_list,)
                continue
            break
        elif t is list and a and type(a[0]) is float:  # a foreach op's scalar list
            part = ()
            for e in a:
                if type(e) is not float:
                    break
                part += (float if info.floats_by_type else (float, e),)
            else:
                fast_key += (part,)
                fast_locals += (a,)
                continue
            break
        else:
            break
        fast_locals += (a,)
    else:
        fast_ok = True
        if kwargs:  # scalar keywords (``clone``'s memory_format), keyed by name
            for name, a in kwargs.items():
                t = type(a)
                if t in _AS_IS:
                    fast_key += ((name, a),)
                elif t is float:
                    fast_key += ((name, float if info.floats_by_type else (float, a)),)
                elif t is bool:
                    fast_key += ((name, _TRUE if a else _FALSE),)
                else:
                    fast_ok = False
                    break
    if fast_ok:
        hit = info.fast.get(fast_key)
        if hit is not None and hit[1] == fast_specs:
            plan = hit[0]
            if plan.direct:
                out = plan.fn(*fast_locals, **kwargs)
                if not self._inline_wrap:
                    return tensor_type(out, plan.single)  # type: ignore[arg-type]
                # DTensor.__new__(out, plan.single), inline: one frame less per op
                single = plan.single
                meta = single.tensor_meta  # type: ignore[union-attr]
                r = _make_wrapper(
                    tensor_type,
                    meta.shape,
                    meta.stride,
                    None,
                    None,
                    meta.dtype,
                    out.layout,
                    out.device,
                    False,
                    False,
                )
                r._local_tensor = out
                r._spec = single
                if not plan.fresh:
                    if meta.dtype.is_complex and out.is_conj():
                        torch._C._set_conj(r, True)
                    if out.is_neg():
                        torch._C._set_neg(r, True)
                return r
            return self.run_plan(plan, args, kwargs, list(fast_dts), list(fast_locals))
    dtensors: list[DTensor] = []
    parts: list[Any] = []
    flat_locals: list[Any] = []
    flat = True  # no DTensor inside a list or in kwargs: flat_locals is the local call
    by_type = info.floats_by_type
    try:
        # Dispatcher.key inlined for the top-level arguments (it also collects the local
        # call): calling it instead made a DTensor train step ~10% more Python calls
        # (bench/step_bench.py, ours_dtensor); test_dispatcher checks both agree.
        for a in args:
            if isinstance(a, tensor_type):
                dtensors.append(a)
                parts.append(a._spec)
                flat_locals.append(a._local_tensor)
                continue
            flat_locals.append(a)
            if type(a) is list and a and type(a[0]) is int:
                parts.append(tuple(a))
            elif isinstance(a, (list, tuple)):
                n = len(dtensors)
                parts.append(self.key(a, dtensors, by_type))
                if len(dtensors) != n:
                    flat = False
            elif isinstance(a, torch.Tensor):
                if a.ndim:
                    raise _MixedTensorError
                parts.append((a.dtype, a.device))
            elif type(a) is float:
                parts.append(float if by_type else (float, a))
            elif type(a) is bool:
                parts.append(_TRUE if a else _FALSE)
            else:
                parts.append(a)
        key = tuple(parts)
        if kwargs:
            n = len(dtensors)
            key = (*key, *self.key(tuple(kwargs.items()), dtensors, by_type))
            if len(dtensors) != n:
                flat = False
    except _MixedTensorError:
        return self._mixed(func, args, kwargs)
    try:
        plan = info.plans.get(key)
    except TypeError:  # an unhashable argument: plan without caching
        plan = self.derive_plan(info, None, args, kwargs, dtensors)
    else:
        if plan is None:
            plan = self.derive_plan(info, key, args, kwargs, dtensors)
        if fast_ok:  # the fast path missed: file the plan under its key
            if len(info.fast) >= _MAX_FAST_PER_OP:
                info.fast.clear()
            info.fast[fast_key] = (plan, tuple(self.intern_spec(s) for s in fast_specs))
    return self.run_plan(plan, args, kwargs, dtensors, flat_locals if flat else None)

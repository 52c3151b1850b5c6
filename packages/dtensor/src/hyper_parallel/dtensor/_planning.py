"""Sharding plans: derive one per op and argument layouts, run it.

A plan is derived once per op and cache key (:meth:`Planner.derive_plan`), in phases:
the op runs on meta tensors for the global output metadata, the op's rule (see
``_registry``) answers a :class:`~hyper_parallel.dtensor._registry.Decision`, and
everything a call needs is precomputed: which inputs move, the output specs, what the
op writes and returns. :meth:`Planner.run_plan` then does only that work per call.

An op without a usable rule (none registered, or the rule declined, or its meta
computation failed) gets a *fallback plan*: gather every input to Replicate, run the op
on full tensors, return Replicate, and write the new value of an in-place argument back
in its own layout (a Partial one becomes Replicate). Always correct, never fast: it
warns once per op (:class:`FallbackWarning`) and counts every call. A rule that raises,
or answers something impossible, is a bug: its error propagates. Under
:func:`strict_mode` (or ``HYPER_PARALLEL_STRICT=1``) a fallback raises
:class:`FallbackError` instead of running.

The planner works on DTensors of the class it is built for (the dispatcher that the
DTensor class holds is a planner), so nothing here imports the class.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor._ops._strategy import decision_cost
from hyper_parallel.dtensor._redistribute import PlacementError, redistribute_local
from hyper_parallel.dtensor._registry import (
    Decision,
    Declined,
    LocalFn,
    OpCall,
    Rewrite,
    Rule,
    RuleRegistry,
    Special,
)
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    local_shape_and_offset,
    replicate_all,
)
from hyper_parallel.dtensor._strided import (
    has_strided,
    keeps_strided,
    restore_strided,
    sees_strided,
    shown_call,
)
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor

__all__ = [
    "FallbackError",
    "FallbackWarning",
    "OpInfo",
    "Plan",
    "Planner",
    "Result",
    "RuleError",
    "derive_op_info",
    "strict_mode",
]

Placements = tuple[Placement, ...]
TensorType = type["DTensor"]


class Result(enum.Enum):
    """How an op's result is built from the local call's result."""

    WRAP = "wrap"  # wrap every tensor output with its planned spec
    ALIASES = "aliases"  # return the written DTensor arguments the schema's returns alias
    NOTHING = "nothing"  # the op returns nothing (e.g. in-place foreach ops)


_WRAP = Result.WRAP  # the hot path compares with a module global, not an enum attribute

_MAX_PLANS_PER_OP = 1024
_MAX_INTERNED_SPECS = 4096


class FallbackWarning(UserWarning):
    """An op ran through the gather-compute-replicate fallback (correct, but slow)."""


class FallbackError(RuntimeError):
    """Under :func:`strict_mode`, an op would have run through the fallback."""


class RuleError(RuntimeError):
    """A sharding rule gave an impossible answer (a bug in the rule, not a fallback)."""


_strict: ContextVar[bool | None] = ContextVar("hp_strict_fallbacks", default=None)


@contextmanager
def strict_mode(enabled: bool = True) -> Iterator[None]:
    """Make every fallback raise :class:`FallbackError` (``enabled=False``: allow them again).

    Outside any ``strict_mode`` block, the environment variable
    ``HYPER_PARALLEL_STRICT=1`` makes fallbacks raise.

    Example::

        with strict_mode():
            torch.sort(dt)   # FallbackError: aten.sort.stable has no sharding rule
    """
    token = _strict.set(enabled)
    try:
        yield
    finally:
        _strict.reset(token)


def _strict_now() -> bool:
    enabled = _strict.get()
    if enabled is None:
        return os.environ.get("HYPER_PARALLEL_STRICT", "") not in ("", "0")
    return enabled


@dataclass(slots=True)
class OpInfo:
    """What planning knows about one op overload, computed once from its schema and the registry."""

    func: torch._ops.OpOverload
    special: Special | None
    rule: Rule | None
    floats_by_type: bool  # float arguments key the cache by type only (the rule ignores values)
    written: tuple[str, ...]  # names of the arguments the op writes
    return_aliases: tuple[str | None, ...]  # per schema return: the written argument it is
    returns_list: bool  # the op returns a Tensor[] (its outputs as a list)
    plans: dict[Any, Plan] = field(default_factory=dict)
    # the dispatcher's fast path: its key (spec hashes for specs, else as ``plans``) ->
    # (plan, the specs it was derived for); a hit is used only when the specs are equal
    fast: dict[Any, tuple[Plan, tuple[DTensorSpec, ...]]] = field(default_factory=dict)
    # no return aliases an argument: a result is a fresh tensor (never a lazily
    # conjugated or negated view)
    fresh_returns: bool = False
    owner: Any = None  # the dispatcher that derived it


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one call needs, precomputed from the rule's decision (or a fallback plan)."""

    fallback: bool
    fn: LocalFn
    mutated: tuple[int, ...]  # DTensor indices the op writes
    result: Result
    returned: tuple[tuple[int, ...], ...]  # per return: DTensor indices it aliases
    moves: tuple[tuple[int, Placements], ...] = ()  # (DTensor index, target) of moving inputs
    moved_specs: tuple[DTensorSpec | None, ...] = ()  # spec after the move, per DTensor
    relabel: tuple[tuple[int, DTensorSpec], ...] = ()  # written DTensors whose layout changes
    single: DTensorSpec | None = None  # the op returns one tensor, wrapped with this spec
    out_specs: tuple[DTensorSpec | None, ...] = ()
    out_local_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    rewrite: Rewrite | None = None
    reason: str = ""
    outside: bool = False  # this rank is not in the mesh: it holds empty locals, computes nothing
    returns_list: bool = False
    decision: Decision | None = None  # the rule's answer (None for a fallback plan)
    cost: float = 0.0  # bytes a rank sends: input moves and in-kernel reductions (estimate)
    # the local call is the op itself on fresh results (no rule's local function): its
    # result carries no lazy conjugate or negative bit for the wrapper to copy
    fresh: bool = False
    # nothing moves or is rewritten, one result wrapped as ``single``: the dispatcher's
    # fast path runs ``fn`` on the local arguments itself (what ``run_plan`` would do)
    direct: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        direct = (
            not self.fallback
            and not self.outside
            and not self.moves
            and self.rewrite is None
            and self.single is not None
        )
        object.__setattr__(self, "direct", direct)


def derive_op_info(func: torch._ops.OpOverload, registry: RuleRegistry) -> OpInfo:
    """The planning state of ``func``: its schema's aliasing, its rule or special.

    Example::

        derive_op_info(torch.ops.aten.mm.default, registry).rule   # the matrix-product rule
    """
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
    rule = registry.rule_for(func)
    special = registry.special_for(func)
    if special is None and rule is None and _composite(func):
        special = _decompose
    returns = schema.returns
    return OpInfo(
        func=func,
        special=special,
        rule=rule,
        floats_by_type=torch.Tag.pointwise in func.tags
        or schema.name.startswith("aten::_foreach_"),
        written=written,
        return_aliases=tuple(aliases),
        returns_list=len(returns) == 1 and str(returns[0].type).startswith("List"),
        fresh_returns=all(r.alias_info is None for r in returns),
    )


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


_KEEPS_WRITTEN_LAYOUT = (
    "no layout of its sharding rule keeps the placements of the tensor it writes in place"
)


@dataclass(frozen=True, slots=True)
class _Mutation:
    """What an op writes and returns, as DTensor indices of one call."""

    mutated: tuple[int, ...] = ()
    result: Result = Result.WRAP
    returned: tuple[tuple[int, ...], ...] = ()


class Planner:
    """Derives and runs plans for calls on DTensors of one class.

    Holds the class (to find, build and swap DTensors in arguments), the count of
    derivations and the fallback counts. :class:`~hyper_parallel.dtensor._dispatch.Dispatcher`
    extends it with keying and the plan cache.
    """

    def __init__(self, tensor_type: TensorType) -> None:
        self.tensor_type = tensor_type
        # results may be built inline, as the class's plain constructor builds them
        # (a Dispatcher decides from its class)
        self._inline_wrap = False
        self._specs: dict[DTensorSpec, DTensorSpec] = {}  # intern_spec's table
        self.derivations = 0  # sharding decisions derived (cache misses)
        self.fallbacks: Counter[str] = Counter()  # fallback calls per op

    # -- deriving a plan ---------------------------------------------------------------

    def intern_spec(self, spec: DTensorSpec) -> DTensorSpec:
        """The one spec object this planner uses for ``spec``'s value (itself, the first time).

        Bounded: the table starts over when full (a later equal spec is then another
        object, which compares by value).

        Example::

            dispatcher.intern_spec(dt._spec) is dispatcher.intern_spec(dt._spec)  # True
        """
        found = self._specs.get(spec)
        if found is None:
            if len(self._specs) >= _MAX_INTERNED_SPECS:
                self._specs.clear()
            found = self._specs[spec] = spec
        return found

    def derive_plan(
        self,
        info: OpInfo,
        key: tuple[Any, ...] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dtensors: list[DTensor],
    ) -> Plan:
        """Derive the plan of a call and cache it under ``key`` (``None``: an uncacheable call).

        Example::

            plan = dispatcher.derive_plan(info, key, (a, b), {}, [a, b])
        """
        plan = self._make_plan(info, args, kwargs, dtensors)
        if key is not None:
            if len(info.plans) >= _MAX_PLANS_PER_OP:
                info.plans.clear()
            info.plans[key] = plan
        return plan

    def _make_plan(
        self,
        info: OpInfo,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dtensors: list[DTensor],
    ) -> Plan:
        self.derivations += 1
        mutation = self._mutation(info, args, kwargs)
        if info.rule is None:
            return _fallback_plan(info, mutation, "it has no sharding rule")
        specs = [dt._spec for dt in dtensors]
        mesh = common_mesh(info.func, specs)
        meta_out = self._meta_run(info.func, args, kwargs, specs)
        if isinstance(meta_out, str):
            return _fallback_plan(info, mutation, meta_out)
        out_metas = [
            TensorMeta(o.shape, o.stride(), o.dtype) if isinstance(o, torch.Tensor) else None
            for o in _flatten_outputs(meta_out)
        ]
        spec_args, spec_kwargs = self.swap_dtensors(args, kwargs, specs)
        call = OpCall(info.func, spec_args, spec_kwargs, specs, mesh, out_metas)
        if has_strided(specs):
            decision = _decide_on_strided(info.rule, call)
        else:
            decision = _decide(info.rule, call)
        if isinstance(decision, str):
            return _fallback_plan(info, mutation, decision)
        moves, moved_specs = _moves(specs, decision)
        # An in-place or out= op keeps the layout of the tensor it writes (as torch), so views
        # of it stay valid; a rule that would move it gives way to the fallback, which
        # writes the result back in the tensor's own layout.
        keeps_layout = torch.Tag.inplace_view not in info.func.tags
        if keeps_layout and any(moved_specs[i] for i in mutation.mutated):
            return _fallback_plan(info, mutation, _KEEPS_WRITTEN_LAYOUT)
        out_specs, out_local_shapes = _outputs(mesh, out_metas, decision)
        # one object per spec value among results: the dispatcher's fast path compares
        # the specs of later calls by identity first
        out_specs = tuple(None if o is None else self.intern_spec(o) for o in out_specs)
        relabel = _relabel(mutation, specs, moved_specs, out_specs)
        if relabel and keeps_layout:
            return _fallback_plan(info, mutation, _KEEPS_WRITTEN_LAYOUT)
        single = None
        if mutation.result is Result.WRAP and isinstance(meta_out, torch.Tensor):
            single = out_specs[0]
        return Plan(
            fallback=False,
            fn=decision.local_fn or info.func._op,
            mutated=mutation.mutated,
            result=mutation.result,
            returned=mutation.returned,
            moves=moves,
            moved_specs=moved_specs,
            relabel=relabel,
            single=single,
            fresh=decision.local_fn is None and info.fresh_returns,
            out_specs=out_specs,
            out_local_shapes=out_local_shapes,
            rewrite=decision.rewrite,
            outside=mesh.get_coordinate() is None,
            returns_list=info.returns_list,
            decision=decision,
            cost=decision_cost(call, decision),
        )

    def _meta_run(
        self,
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        specs: list[DTensorSpec],
    ) -> Any:
        """The op's output on meta tensors of the global shapes (a str: why it failed)."""
        meta_args, meta_kwargs = self.swap_dtensors(args, kwargs, [_meta_like(s) for s in specs])
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        if meta_kwargs.get("pin_memory"):
            meta_kwargs["pin_memory"] = False
        try:
            return func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            return f"its meta computation failed ({exc})"

    def _mutation(self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Mutation:
        """Which DTensors the op writes, and which of them it returns."""
        if not info.written:
            return _Mutation()
        by_arg = self._dtensor_indices_by_argument(info.func, args, kwargs)
        mutated: list[int] = []
        for name in info.written:
            mutated.extend(by_arg.get(name, ()))
        if not info.return_aliases:
            return _Mutation(tuple(mutated), Result.NOTHING)
        if all(name is not None for name in info.return_aliases):
            returned = tuple(by_arg.get(name or "", ()) for name in info.return_aliases)
            if all(returned):  # else a written argument is a plain tensor: wrap the result
                return _Mutation(tuple(mutated), Result.ALIASES, returned)
        return _Mutation(tuple(mutated))

    def _dtensor_indices_by_argument(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, tuple[int, ...]]:
        """Schema argument name -> indices (in dispatch order) of the DTensors it holds."""
        names = [a.name for a in func._schema.arguments]
        result: dict[str, tuple[int, ...]] = {}
        start = 0
        for i, a in enumerate(args):
            n = self._count_dtensors(a)
            if i < len(names):
                result[names[i]] = tuple(range(start, start + n))
            start += n
        for k, v in kwargs.items():
            n = self._count_dtensors(v)
            result[k] = tuple(range(start, start + n))
            start += n
        return result

    def _count_dtensors(self, value: Any) -> int:
        if isinstance(value, self.tensor_type):
            return 1
        if isinstance(value, (list, tuple)):
            return sum(self._count_dtensors(v) for v in value)
        return 0

    def swap_dtensors(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], replacements: Sequence[Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args``/``kwargs`` with each DTensor replaced, in order, by ``replacements``.

        Example::

            local_args, local_kwargs = dispatcher.swap_dtensors((a, 2), {}, [a._local_tensor])
        """
        it = iter(replacements)
        new_args = tuple(self._swap(a, it) for a in args)
        new_kwargs = {k: self._swap(v, it) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _swap(self, value: Any, it: Iterator[Any]) -> Any:
        tensor_type = self.tensor_type
        if isinstance(value, tensor_type):
            return next(it)
        if isinstance(value, (list, tuple)) and any(
            isinstance(v, (tensor_type, list, tuple)) for v in value
        ):
            return type(value)(self._swap(v, it) for v in value)
        return value

    # -- running a plan ----------------------------------------------------------------

    def run_plan(
        self,
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

            out = dispatcher.run_plan(plan, (a, b), {}, [a, b], [a._local_tensor, b._local_tensor])
        """
        if plan.fallback:
            return self._run_fallback(plan, args, kwargs, dtensors)
        if plan.outside:
            return self._outside_mesh_result(plan, dtensors)
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
            local_args, local_kwargs = self.swap_dtensors(args, kwargs, locals_)
        elif flat_locals is not None:
            local_args, local_kwargs = flat_locals, kwargs
        else:
            local_args, local_kwargs = self.swap_dtensors(
                args, kwargs, [dt._local_tensor for dt in dtensors]
            )
        if plan.rewrite is not None:
            local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.out_local_shapes)
        out = plan.fn(*local_args, **local_kwargs)
        single = plan.single
        if single is not None:
            return self.tensor_type(out, single)
        if plan.result is _WRAP:
            if (
                plan.returns_list
                and plan.fresh
                and self._inline_wrap
                and len(out) == len(plan.out_specs)
            ):
                # a foreach op's fresh results (an optimizer's ``_foreach_sqrt``): the
                # wrappers built inline, as DTensor.__new__ builds them
                wrapped: list[Any] = []
                make = torch.Tensor._make_wrapper_subclass
                tensor_type = self.tensor_type
                for o, spec in zip(out, plan.out_specs):  # noqa: B905 (lengths checked)
                    if spec is None:
                        wrapped += (o,)
                        continue
                    meta = spec.tensor_meta
                    r = make(
                        tensor_type,
                        meta.shape,
                        meta.stride,
                        None,
                        None,
                        meta.dtype,
                        o.layout,
                        o.device,
                        False,
                        False,
                    )
                    r._local_tensor = o
                    r._spec = spec
                    wrapped += (r,)
                return wrapped
            return self._wrap(out, iter(plan.out_specs))
        for i, spec in plan.relabel:
            dtensors[i]._spec = spec
        return _aliased_result(plan, out, dtensors)

    def _wrap(self, out: Any, specs: Iterator[DTensorSpec | None]) -> Any:
        if isinstance(out, torch.Tensor):
            spec = next(specs)
            if spec is None:
                return out
            return self.tensor_type(out, spec)
        if isinstance(out, (list, tuple)):
            return type(out)(self._wrap(o, specs) for o in out)
        next(specs, None)
        return out

    def _run_fallback(
        self,
        plan: Plan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dtensors: list[DTensor],
    ) -> Any:
        func = plan.fn
        name = str(func)
        if _strict_now():
            raise FallbackError(
                f"hyper_parallel.dtensor: {name} would run on full tensors (the gather "
                f"fallback) because {plan.reason}; strict mode (strict_mode() or "
                "HYPER_PARALLEL_STRICT=1) forbids fallbacks"
            )
        if not dtensors:
            out = func(*args, **kwargs)
            self._ran_fallback(name, plan.reason)
            return out
        mesh = common_mesh(func, [dt._spec for dt in dtensors])  # type: ignore[arg-type]
        replicate = replicate_all(mesh.ndim)
        fulls = [redistribute_local(dt._local_tensor, dt._spec, replicate) for dt in dtensors]
        full_args, full_kwargs = self.swap_dtensors(args, kwargs, fulls)
        out = func(*full_args, **full_kwargs)
        self._ran_fallback(name, plan.reason)
        for i in plan.mutated:
            _write_back(dtensors[i], fulls[i])
        if plan.result is _WRAP:
            return self._wrap_replicated(out, mesh)
        return _aliased_result(plan, out, dtensors)

    def _ran_fallback(self, name: str, reason: str) -> None:
        """Count a fallback that ran, and warn at its op's first (after it ran: an op that
        raises on the full tensors, e.g. ``mean`` of integers, gets torch's error alone)."""
        self.fallbacks[name] += 1
        if self.fallbacks[name] == 1:
            warnings.warn(
                f"hyper_parallel.dtensor: {name} ran on full tensors (gathered to Replicate) and "
                f"returned Replicate because {reason}. Correct, but it communicates and "
                "computes the whole tensor on every rank.",
                FallbackWarning,
                stacklevel=6,
            )

    def _outside_mesh_result(self, plan: Plan, dtensors: list[DTensor]) -> Any:
        """On a rank outside the mesh an op computes nothing: empty locals, as in torch."""
        if plan.result is not _WRAP:
            return _aliased_result(plan, None, dtensors)
        device = dtensors[0]._local_tensor.device
        outs = [
            None if spec is None else self.tensor_type(_outside_local(spec, device), spec)
            for spec in plan.out_specs
        ]
        if plan.single is not None:
            return outs[0]
        if plan.returns_list:
            return outs
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _wrap_replicated(self, out: Any, mesh: DeviceMesh) -> Any:
        if isinstance(out, torch.Tensor):
            meta = TensorMeta(out.shape, out.stride(), out.dtype)
            return self.tensor_type(out, DTensorSpec(mesh, replicate_all(mesh.ndim), meta))
        if isinstance(out, (list, tuple)):
            return type(out)(self._wrap_replicated(o, mesh) for o in out)
        return out


# -- the phases of a plan that need no DTensor ------------------------------------------


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


def common_mesh(func: torch._ops.OpOverload, specs: Sequence[DTensorSpec]) -> DeviceMesh:
    """The one mesh of a call's DTensor arguments (raises naming both when they differ).

    The error is a ``PlacementError``: a ``RuntimeError`` as torch's, and a ``ValueError``.
    """
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise PlacementError(
                f"{func}: DTensor arguments live on different meshes: {mesh} and {s.mesh}"
            )
    return mesh


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


def _aliased_result(plan: Plan, out: Any, dtensors: list[DTensor]) -> Any:
    if plan.result is Result.NOTHING:
        return out
    results: list[Any] = []
    for indices in plan.returned:
        if len(indices) == 1:
            results.append(dtensors[indices[0]])
        else:
            results.append([dtensors[i] for i in indices])
    return results[0] if len(results) == 1 else tuple(results)


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


def _outside_local(spec: DTensorSpec, device: torch.device) -> torch.Tensor:
    """torch's local tensor off the mesh: a 0-dim zero for a scalar result, else empty."""
    dtype = spec.tensor_meta.dtype
    if not spec.shape:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.empty(0, dtype=dtype, device=device)

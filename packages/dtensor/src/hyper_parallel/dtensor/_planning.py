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
DTensor class holds is a planner), so nothing here imports the class. The plan's types
live in ``_plan``, the phases of a derivation that need no DTensor in ``_plan_phases``.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor._ops._strategy import decision_cost
from hyper_parallel.dtensor._plan import OpInfo, Plan, Result, _Mutation, derive_op_info
from hyper_parallel.dtensor._plan_phases import (
    RuleError,
    _decide,
    _decide_on_strided,
    _fallback_plan,
    _flatten_outputs,
    _meta_like,
    _moves,
    _outputs,
    _relabel,
)
from hyper_parallel.dtensor._redistribute import PlacementError, redistribute_local
from hyper_parallel.dtensor._registry import OpCall
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta, replicate_all
from hyper_parallel.dtensor._strided import has_strided
from hyper_parallel.dtensor.device_mesh import DeviceMesh

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

TensorType = type["DTensor"]

_WRAP = Result.WRAP  # the hot path compares with a module global, not an enum attribute

_MAX_PLANS_PER_OP = 1024
_MAX_INTERNED_SPECS = 4096


class FallbackWarning(UserWarning):
    """An op ran through the gather-compute-replicate fallback (correct, but slow)."""


class FallbackError(RuntimeError):
    """Under :func:`strict_mode`, an op would have run through the fallback."""


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


_KEEPS_WRITTEN_LAYOUT = (
    "no layout of its sharding rule keeps the placements of the tensor it writes in place"
)


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

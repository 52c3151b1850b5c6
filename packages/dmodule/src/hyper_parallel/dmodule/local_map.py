"""local_map: run a module's forward on the local shards of its states and inputs.

Inside a ``local_map`` block ops run on plain tensors (no DTensor dispatch); the
block writes its own collectives when it needs any and declares the layout of what
it returns with ``out_src_shardings``.

A call crosses the DTensor boundary twice, each time through one autograd Function:

* :class:`_EnterLocal` takes every laid-out input (wrap, redistribute, ``to_local``)
  in one node; its backward lays each input gradient out as the input's declared
  ``in_grad_placements`` and moves it back, as ``to_local`` then ``enforce_layout``
  then ``from_local`` would one by one;
* :class:`_ExitLocal` wraps every plain output (``from_local`` as ``out_src``, then
  ``redistribute`` to ``out_dst``) in one node, and its backward undoes both.

Between them the block's own ops record an ordinary autograd graph, so tensors the
block reads from elsewhere (a closure, another module) keep their gradients, and
activation checkpointing and ``torch.compile`` see plain ops. A single Function around
the whole call would need a re-entrant backward (``torch.autograd.grad`` inside
``backward``), which drops those gradients and defeats both.

The states' local shards are taken once per step, all of a module's through one autograd
node (:class:`_StatesLocal`, whose backward wraps every state's gradient): the views are
kept and reused while each parameter object, its shard and the shard's version counter
are unchanged (an optimizer's in-place update bumps the version, and a ``swap_tensors``
or re-assignment changes the shard or the object).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from hyper_parallel.dmodule._state_grads import declared_grad_layouts
from hyper_parallel.dtensor import DeviceMesh, DTensor, Partial, Placement, Replicate, collectives

__all__ = ["local_states"]

Placements: TypeAlias = tuple[Placement, ...]


@contextmanager
def local_states(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, every DTensor parameter and buffer of ``module``'s subtree is local.

    Each is replaced by ``to_local()`` (differentiable, so gradients flow to the DTensor
    parameter) and put back on exit, also when the block raises.

    Example::

        with local_states(block):
            y = block.forward(x_local)   # block.weight is this rank's shard here
    """
    slots = dtensor_states(module)
    swap_in(slots, [value.to_local() for _, _, value in slots])
    try:
        yield
    finally:
        swap_back(slots)


StateSlot: TypeAlias = tuple[dict[str, Any], str, DTensor]


def dtensor_states(module: torch.nn.Module) -> list[StateSlot]:
    """``(owner dict, name, DTensor)`` for every DTensor parameter and buffer of the subtree.

    Example::

        >>> dtensor_states(torch.nn.Linear(2, 2))   # plain states: none
        []
    """
    # Every local_map call walks its module: the loop makes no Python call per state
    # (exact-type check first, no list methods) and none for a module without children.
    found: list[StateSlot] = []
    sub = module
    stack: list[torch.nn.Module] = []
    while True:
        for states in (sub._parameters, sub._buffers):
            for name in states:
                value = states[name]
                if type(value) is DTensor or (value is not None and isinstance(value, DTensor)):
                    found += ((states, name, value),)
        if sub._modules:
            stack += [child for child in sub._modules.values() if child is not None]
        if not stack:
            return found
        sub = stack.pop()


# -- the states' local views, once per step ------------------------------------------------


@dataclass(slots=True)
class _View:
    """A DTensor state's ``to_local`` view and what it was taken from."""

    state: DTensor
    shard: torch.Tensor
    version: int
    requires_grad: bool
    view: torch.Tensor


# module -> the view of each of its states, in ``dtensor_states`` order; weak on the module
# only (states refuse weak references under ``torch.utils.swap_tensors``, which
# ``Module.to_empty`` uses)
_views: weakref.WeakKeyDictionary[torch.nn.Module, list[_View]] = weakref.WeakKeyDictionary()


def _local_views(
    module: torch.nn.Module, slots: Sequence[StateSlot], shards: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The differentiable local view of each state, reused while they are still the states'.

    The views are taken together, through one autograd node for the whole module
    (:class:`_StatesLocal`), and re-taken together when any state changed.
    """
    kept = _views.get(module)
    if kept is not None and len(kept) == len(slots):
        # kept[i] is the view of slots[i]'s state, checked without a call
        for entry, (_, _, state), shard in zip(kept, slots, shards, strict=True):
            if (
                entry.state is not state
                or entry.shard is not shard
                or entry.version != shard._version
                or entry.requires_grad != state.requires_grad
            ):
                break
        else:
            return [entry.view for entry in kept]
    states = [state for _, _, state in slots]
    grads = declared_grad_layouts(module, slots)
    views: Sequence[torch.Tensor] = _StatesLocal.apply(grads, *states) if states else ()
    _views[module] = [
        _View(state, shard, shard._version, state.requires_grad, view)
        for state, shard, view in zip(states, shards, views, strict=True)
    ]
    return list(views)


class _StatesLocal(torch.autograd.Function):
    """``to_local()`` of every DTensor state of one module, in one node.

    The backward lays each state's local gradient out as the state (its placements, its
    global shape, contiguous), as ``to_local``'s backward does: one backward call per
    module and step instead of one per state.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, grads: Sequence[Placements | None] | None, *states: DTensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.layouts = [(s.device_mesh, s.placements, tuple(s.shape)) for s in states]
        if grads is not None:  # declared gradient layouts (local_map.state_grad_placements)
            ctx.layouts = [
                (mesh, placements if grad is None else grad, shape)
                for (mesh, placements, shape), grad in zip(ctx.layouts, grads, strict=True)
            ]
        # each gradient's spec, once known: the node is kept (with the views) across steps
        ctx.grad_specs = [None] * len(states)
        views = []
        for state in states:
            local = state.to_local()  # grad mode is off here: the shard itself
            views.append(local.view_as(local))
        idle = [view for view, state in zip(views, states, strict=True) if not state.requires_grad]
        if idle:
            ctx.mark_non_differentiable(*idle)
        ctx.set_materialize_grads(False)
        return tuple(views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:  # type: ignore[override]
        out: list[DTensor | None] = []
        specs = ctx.grad_specs
        for i, grad in enumerate(grads):
            if grad is None:
                out += (None,)
                continue
            known = specs[i]
            if known is None or known[0] is not grad.dtype:
                mesh, placements, shape = ctx.layouts[i]
                dt = wrap_local(grad, mesh, placements, shape)
                specs[i] = (grad.dtype, dt.__tensor_flatten__()[1][0])
                out += (dt,)
                continue
            out += (DTensor(grad, known[1]),)
        return (None, *out)


def clear_local_views(module: torch.nn.Module | None = None) -> None:
    """Forget the kept local views of ``module``'s states (of every module when ``None``).

    Never needed for correctness (a view is re-taken when its state changes); frees the
    views of a model that is done training.

    Example::

        >>> clear_local_views()
    """
    if module is None:
        _views.clear()
    else:
        _views.pop(module, None)


# -- gradient layouts (torch DTensor's rules) --------------------------------------------------


def grad_target(forward: Placements, grad: Placements) -> Placements:
    """Where a redistributed input's gradient goes: the input's layout, a non-Partial
    gradient of a Partial input staying Replicate (torch DTensor's rule).

    Example::

        >>> from hyper_parallel.dtensor import Partial
        >>> grad_target((Replicate(),), (Partial(),))
        (Replicate(),)
    """
    key = (forward, grad)  # placements hash by identity: no Python call to look up
    if key in _grad_targets:
        return _grad_targets[key]
    target = tuple(
        [
            Replicate() if fwd.is_partial() and not cur.is_partial() else fwd
            for fwd, cur in zip(forward, grad, strict=True)
        ]
    )
    return _remember(_grad_targets, key, target)


def partial_to_replicate(placements: Placements) -> Placements:
    """The placements of a leaf's gradient: Partial made Replicate.

    Example::

        >>> from hyper_parallel.dtensor import Partial
        >>> partial_to_replicate((Partial(),))
        (Replicate(),)
    """
    if placements in _leaf_grads:
        return _leaf_grads[placements]
    target = tuple([Replicate() if p.is_partial() else p for p in placements])
    return _remember(_leaf_grads, placements, target)


# Both are asked on every backward through the boundary: their answers are kept.
_grad_targets: dict[tuple[Placements, Placements], Placements] = {}
_leaf_grads: dict[Placements, Placements] = {}


def _remember(table: dict[Any, Placements], key: Any, value: Placements) -> Placements:
    if len(table) > 1024:  # bounded, as the layout caches of hp-dtensor
        table.clear()
    table[key] = value
    return value


def reduce_moves(src: Placements, dst: Placements) -> list[tuple[int, str]] | None:
    """The all-reduces ``(mesh axis, reduce op)`` that move ``src`` to ``dst`` when the move is
    only Partial -> Replicate (``[]``: nothing moves); ``None`` for any other move.

    The boundary runs these on the local tensor itself: the collectives ``redistribute``
    issues for such a move, without building a DTensor to redistribute.

    Example::

        >>> from hyper_parallel.dtensor import Partial, Shard
        >>> reduce_moves((Partial(), Shard(0)), (Replicate(), Shard(0)))
        [(0, 'sum')]
        >>> reduce_moves((Shard(0),), (Replicate(),)) is None   # an all-gather
        True
    """
    moves: list[tuple[int, str]] = []
    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s is d:  # placements are one object per value
            continue
        if type(s) is Partial and type(d) is Replicate:
            moves.append((axis, s.reduce_op))
            continue
        return None
    return moves


def _all_reduce_local(
    local: torch.Tensor, mesh: DeviceMesh, moves: Sequence[tuple[int, str]]
) -> torch.Tensor:
    for axis, op in moves:
        local = collectives.all_reduce(local, mesh, axis, op)  # type: ignore[arg-type]
    return local


# Wrapping a local tensor as a DTensor with the spec a first ``from_local`` of that layout
# built (kept per layout): what ``from_local`` builds, without re-deriving the layout or
# rebuilding the spec on every call.
_WrapKey: TypeAlias = tuple[DeviceMesh, Placements, tuple[int, ...], torch.dtype, tuple[int, ...]]
_wrap_specs: dict[_WrapKey, Any] = {}  # the DTensor specs, as __tensor_flatten__ gives them


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def wrap_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Placements,
    global_shape: tuple[int, ...] | None = None,
) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, shape=global_shape)``, no autograd node.

    ``global_shape=None`` is from_local's even-shard global shape. The result is
    contiguous over the global shape and does not require grad.

    Example::

        dt = wrap_local(torch.ones(2, 4), mesh, (Shard(0),))   # global (4, 4) on 2 ranks
    """
    key = (mesh, placements, tuple(local.shape), local.dtype, global_shape or ())
    spec = _wrap_specs.get(key)
    if spec is None:
        spec = _wrap_spec(local, mesh, placements, global_shape)
        if len(_wrap_specs) >= 4096:  # bounded, as the layout caches of hp-dtensor
            _wrap_specs.pop(next(iter(_wrap_specs)))
        _wrap_specs[key] = spec
    return DTensor(local, spec)


def _wrap_spec(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Placements,
    global_shape: tuple[int, ...] | None,
) -> Any:
    """The spec ``from_local`` gives ``local``'s shape and dtype, contiguous over the global
    shape (taken through the subclass protocol, ``__tensor_flatten__``/``__tensor_unflatten__``)."""
    probe = torch.empty(tuple(local.shape), dtype=local.dtype, device="meta")
    with torch.no_grad():
        if global_shape is None:
            template = DTensor.from_local(probe, mesh, placements)
        else:
            template = DTensor.from_local(
                probe, mesh, placements, shape=global_shape, stride=_contiguous(global_shape)
            )
    _, context = template.__tensor_flatten__()
    shape = tuple(template.shape)
    contiguous = DTensor.__tensor_unflatten__(
        {"_local_tensor": probe}, context, shape, _contiguous(shape)
    )
    return contiguous.__tensor_flatten__()[1][0]


# -- the two boundary Functions ----------------------------------------------------------------


@dataclass(slots=True)
class InputStep:
    """How one input tensor enters the block: wrap as ``layout`` (a plain tensor), move to
    ``dst``; the gradient is laid out as ``grad`` and moved back."""

    layout: Placements | None  # from_local layout of a plain input; None for a DTensor
    dst: Placements | None
    grad: Placements | None
    # filled in forward, read in backward
    before: Placements = ()
    global_shape: tuple[int, ...] = ()
    grad_layout: Placements = ()


class _EnterLocal(torch.autograd.Function):
    """Every laid-out input of one local_map call to its local tensor, in one node."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        mesh: DeviceMesh,
        steps: list[InputStep],
        shard_sink: list[torch.Tensor],
        states: Sequence[DTensor],
        *values: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.mesh, ctx.steps = mesh, steps
        # grad mode is off here: to_local is the shard itself, with no node
        shard_sink += [state.to_local() for state in states]
        outs: list[torch.Tensor] = []
        idle: list[torch.Tensor] = []
        for step, value in zip(steps, values, strict=True):
            if step.layout is not None:
                dt = wrap_local(value, mesh, step.layout)
                step.before = step.layout
            else:
                dt = value  # type: ignore[assignment]
                step.before = dt.placements
            here = step.before
            if step.dst is not None and step.dst != here:
                dt = dt.redistribute(mesh, step.dst)
                here = step.dst
            step.global_shape = tuple(dt.shape)
            step.grad_layout = step.grad if step.grad is not None else here
            local = dt.to_local()
            out = local.view_as(local)
            outs.append(out)
            if not value.requires_grad:
                idle.append(out)
        if idle:
            ctx.mark_non_differentiable(*idle)
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        mesh: DeviceMesh = ctx.mesh
        out: list[torch.Tensor | None] = []
        on_mesh = mesh.get_coordinate() is not None
        for step, grad in zip(ctx.steps, grads, strict=True):
            if grad is None:
                out.append(None)
                continue
            if on_mesh and step.dst is not None:
                fast = _enter_grad_by_reduces(step, grad, mesh)
                if fast is not None:
                    out.append(fast)
                    continue
            # to_local's backward: the local gradient in the declared gradient layout
            dt = wrap_local(grad, mesh, step.grad_layout, step.global_shape)
            here = step.grad_layout
            if step.dst is not None:  # enforce_layout's backward, also when nothing moved
                target = grad_target(step.before, here)
                if target != here:
                    dt, here = dt.redistribute(mesh, target), target
            if step.layout is None:
                out.append(dt)
                continue
            target = partial_to_replicate(step.layout)  # from_local's backward
            if target != here:
                dt = dt.redistribute(mesh, target)
            out.append(dt.to_local())
        return (None, None, None, None, *out)


def _enter_grad_by_reduces(
    step: InputStep, grad: torch.Tensor, mesh: DeviceMesh
) -> torch.Tensor | None:
    """``_EnterLocal.backward`` for one input when each of its moves is Partial -> Replicate
    (``None`` otherwise): the same all-reduces on the local gradient, one wrap at the end."""
    assert step.dst is not None
    here = step.grad_layout
    target = grad_target(step.before, here)  # enforce_layout's backward
    moves = reduce_moves(here, target)
    if moves is None:
        return None
    if step.layout is not None:  # from_local's backward
        final = partial_to_replicate(step.layout)
        more = reduce_moves(target, final)
        if more is None:
            return None
        return _all_reduce_local(_all_reduce_local(grad, mesh, moves), mesh, more)
    return wrap_local(_all_reduce_local(grad, mesh, moves), mesh, target, step.global_shape)


@dataclass(slots=True)
class OutputStep:
    """How one plain output leaves the block: wrapped as ``layout``, redistributed to ``dst``."""

    layout: Placements
    dst: Placements | None
    global_shape: tuple[int, ...] = ()


class _ExitLocal(torch.autograd.Function):
    """Every plain output of one local_map call to its DTensor, in one node."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mesh: DeviceMesh, steps: list[OutputStep], *values: torch.Tensor
    ) -> tuple[DTensor, ...]:
        ctx.mesh, ctx.steps = mesh, steps
        outs: list[DTensor] = []
        on_mesh = mesh.get_coordinate() is not None
        for step, value in zip(steps, values, strict=True):
            local = value.detach()
            if step.dst is not None and step.dst != step.layout:
                moves = reduce_moves(step.layout, step.dst) if on_mesh else None
                if moves is not None:  # Partial -> Replicate: all-reduce the local tensor
                    dt = wrap_local(_all_reduce_local(local, mesh, moves), mesh, step.dst)
                    step.global_shape = tuple(dt.shape)  # the even shape of either layout
                    outs.append(dt)
                    continue
                dt = wrap_local(local, mesh, step.layout)
                step.global_shape = tuple(dt.shape)
                dt = dt.redistribute(mesh, step.dst)
            else:
                dt = wrap_local(local, mesh, step.layout)
                step.global_shape = tuple(dt.shape)
            outs.append(dt)
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        mesh: DeviceMesh = ctx.mesh
        out: list[torch.Tensor | None] = []
        for step, grad in zip(ctx.steps, grads, strict=True):
            if grad is None:
                out.append(None)
                continue
            if isinstance(grad, DTensor):
                dt, here = grad, grad.placements
            else:  # a plain gradient of the global shape is taken as replicated, as torch does
                final = step.dst if step.dst is not None else step.layout
                if tuple(grad.shape) == step.global_shape:
                    final = (Replicate(),) * len(final)
                dt, here = wrap_local(grad, mesh, final, step.global_shape), final
            if step.dst is not None and step.dst != step.layout:  # redistribute's backward
                target = grad_target(step.layout, here)
                if target != here:
                    dt, here = dt.redistribute(mesh, target), target
            target = partial_to_replicate(step.layout)  # from_local's backward
            if target != here:
                dt = dt.redistribute(mesh, target)
            out.append(dt.to_local())
        return (None, None, *out)


def enter_local(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    steps: list[InputStep],
    values: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[StateSlot], list[torch.Tensor]]:
    """The local inputs (one node for all), and the states' local views (kept per step).

    Returns ``(local inputs, state slots, local views of the states)``.

    Example::

        locals_, slots, views = enter_local(block, mesh, steps, [x])
    """
    slots = dtensor_states(module)
    states = [state for _, _, state in slots]
    shards: list[torch.Tensor] = []
    if values:
        local_inputs = list(_EnterLocal.apply(mesh, steps, shards, states, *values))
    else:
        local_inputs = []
        with torch.no_grad():
            shards += [state.to_local() for state in states]
    return local_inputs, slots, _local_views(module, slots, shards)


def local_views(module: torch.nn.Module, slots: Sequence[StateSlot]) -> list[torch.Tensor]:
    """The states' local views (one node for all, kept while unchanged), no input moved.

    Example::

        slots = dtensor_states(block)
        views = local_views(block, slots)
    """
    with torch.no_grad():
        shards = [state.to_local() for _, _, state in slots]
    return _local_views(module, slots, shards)


def exit_local(
    mesh: DeviceMesh, steps: list[OutputStep], values: Sequence[torch.Tensor]
) -> tuple[DTensor, ...]:
    """Wrap and move every plain output in one node.

    Example::

        (y,) = exit_local(mesh, [OutputStep((Partial(),), (Replicate(),))], [y_local])
    """
    return _ExitLocal.apply(mesh, steps, *values)  # type: ignore[no-any-return]


def swap_in(slots: Sequence[StateSlot], views: Sequence[torch.Tensor]) -> None:
    """Put ``views`` in the states' places (undo with :func:`swap_back`, in a ``finally``).

    Example::

        swap_in(slots, views)
        try:
            y = block.forward(x_local)
        finally:
            swap_back(slots)
    """
    for (states, name, _), view in zip(slots, views, strict=True):
        states[name] = view


def swap_back(slots: Sequence[StateSlot]) -> None:
    """Put the DTensor states back (see :func:`swap_in`)."""
    for states, name, value in slots:
        states[name] = value

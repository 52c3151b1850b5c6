"""Regions inside a region: a ``local_map`` call made while another one runs.

An OUTER ``local_map`` region crosses the DTensor boundary once (its inputs go local,
its whole subtree's DTensor states are swapped for their local views, its outputs are
wrapped). Every ``local_map`` region its forward calls is an INNER region: it receives
plain local tensors, builds no DTensor, and performs its declared boundary moves as
collectives on the local tensors, each through one autograd Function whose backward
runs the transposed moves (Megatron's f/g):

==========================  =================================  ==========================
declared move (one axis)    forward                            backward (gradient)
==========================  =================================  ==========================
``Replicate`` in, grad      identity                           all-reduce
``Partial``
``Partial`` -> ``Replicate``  all-reduce                         identity
``Shard(d)`` -> ``Replicate`` all-gather on ``d``                  the local slice / reduce-scatter
``Replicate`` -> ``Shard(d)`` the local slice                      all-gather
``Partial`` -> ``Shard(d)``   reduce-scatter on ``d``              all-gather
==========================  =================================  ==========================

The gradient moves are derived with the rules of the DTensor boundary
(:func:`~hyper_parallel.dmodule.local_map.grad_target`,
:func:`~hyper_parallel.dmodule.local_map.partial_to_replicate`), so an inner region issues
the collectives, and computes the values, of the same region called on DTensors. A
plain value between regions is laid out as the last region's output declares, and its
gradient as that layout with ``Partial`` made ``Replicate``.

Under ``torch.compile`` (an outer region with ``LocalMapConfig(compile=True)``) the
moves are torch's functional collectives, which dynamo traces into the region's graph;
eagerly they are hp-dtensor's collectives (``CommDebugMode`` records both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from hyper_parallel.dmodule.local_map import grad_target, partial_to_replicate
from hyper_parallel.dtensor import DeviceMesh, Partial, Placement, Replicate, Shard, collectives

__all__ = ["Conversion", "convert", "input_conversion", "output_conversion"]

Placements: TypeAlias = tuple[Placement, ...]

# How many local_map forwards run now (one thread runs a forward): > 0 makes a local_map
# call an inner region. Read and written as ``_nested.depth`` (no call per region).
depth = 0
# True while a compiled region's forward runs (dynamo reads it when it traces, and guards
# on it): the moves are then torch's functional collectives, which it traces.
compiling = False

# One move of a local tensor along one mesh axis:
# (kind, mesh, axis, tensor dim, reduce op, group size, local rank, process group)
Move: TypeAlias = tuple[str, DeviceMesh, int, int, str, int, int, Any]
Conversion: TypeAlias = tuple[int, bool]
"""``(key of the forward and backward moves, whether the forward moves anything)``."""

_conversions: list[tuple[tuple[Move, ...], tuple[Move, ...]]] = []
_conversion_keys: dict[tuple[tuple[Move, ...], tuple[Move, ...]], int] = {}


def _describe(placements: Placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _moves(mesh: DeviceMesh, src: Placements, dst: Placements, where: str) -> list[Move]:
    """The per-axis moves of a local tensor from ``src`` to ``dst`` (raises naming ``where``)."""
    found: list[Move] = []
    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s is d or s == d:
            continue
        size, group = mesh._size_and_group(axis)
        rank = mesh.get_local_rank(axis) if mesh.get_coordinate() is not None else 0
        if type(s) is Partial and type(d) is Replicate:
            found.append(("all_reduce", mesh, axis, 0, s.reduce_op, size, rank, group))
        elif type(s) is Partial and type(d) is Shard and s.reduce_op in ("sum", "avg"):
            found.append(("reduce_scatter", mesh, axis, d.dim, s.reduce_op, size, rank, group))
        elif type(s) is Shard and type(d) is Replicate:
            found.append(("all_gather", mesh, axis, s.dim, "", size, rank, group))
        elif type(s) is Replicate and type(d) is Shard:
            found.append(("chunk", mesh, axis, d.dim, "", size, rank, group))
        else:
            raise ValueError(
                f"{where}: cannot move a plain local tensor from {_describe(src)} to "
                f"{_describe(dst)} on mesh axis {axis} ({s!r} -> {d!r}) inside an outer "
                "local_map region; supported: Partial -> Replicate, Partial -> Shard, "
                "Shard -> Replicate, Replicate -> Shard (or call this region outside the "
                "outer one, where it takes DTensors)"
            )
    for move in found:  # two axes sharding one tensor dim: their order would matter
        if move[0] != "all_reduce":
            sharing = [
                axis
                for axis, p in enumerate((*src, *dst))
                if type(p) is Shard and p.dim == move[3] and axis % len(src) != move[2]
            ]
            if sharing:
                raise ValueError(
                    f"{where}: moving {_describe(src)} -> {_describe(dst)} inside an outer "
                    f"local_map region: tensor dim {move[3]} is sharded over more than one "
                    "mesh axis, which only the DTensor path handles"
                )
    return found


def _key(fwd: Sequence[Move], bwd: Sequence[Move]) -> Conversion | None:
    if not fwd and not bwd:
        return None
    pair = (tuple(fwd), tuple(bwd))
    key = _conversion_keys.get(pair)
    if key is None:
        key = _conversion_keys[pair] = len(_conversions)
        _conversions.append(pair)
    return key, bool(fwd)


def input_conversion(
    mesh: DeviceMesh,
    src: Placements | None,
    dst: Placements | None,
    grad: Placements | None,
    where: str,
) -> Conversion | None:
    """How a plain input enters an inner region (``None``: it enters as it is).

    The input is taken as laid out by ``src`` (else ``dst``) and moved to ``dst``; its
    gradient, laid out as ``grad`` (else ``dst``), is moved back as the DTensor boundary's
    backward moves it (``enforce_layout``'s, then ``from_local``'s).

    Example::

        conv = input_conversion(mesh, None, (Replicate(),), (Partial(),), "Attention.x")
        x = convert(x, conv, (plan, "x"))   # identity forward, all-reduce backward
    """
    layout = src if src is not None else dst
    if layout is None:
        return None
    here = dst if dst is not None else layout
    fwd = _moves(mesh, layout, here, where)
    g0 = grad if grad is not None else here
    g1 = grad_target(layout, g0) if dst is not None else g0
    g2 = partial_to_replicate(layout)
    bwd = _moves(mesh, g0, g1, f"{where} (gradient)") + _moves(mesh, g1, g2, f"{where} (gradient)")
    return _key(fwd, bwd)


def output_conversion(
    mesh: DeviceMesh, src: Placements | None, dst: Placements | None, where: str
) -> Conversion | None:
    """How a plain output leaves an inner region (``None``: as it is).

    Laid out as ``src`` (else ``dst``), moved to ``dst``; its gradient, laid out as the
    output's layout with ``Partial`` made ``Replicate``, is moved back as the DTensor
    boundary's backward moves it (``redistribute``'s, then ``from_local``'s).

    Example::

        conv = output_conversion(mesh, (Partial(),), (Replicate(),), "Attention.output")
        y = convert(y, conv, (plan, "output"))   # all-reduce forward, identity backward
    """
    layout = src if src is not None else dst
    if layout is None:
        return None
    final = dst if dst is not None else layout
    fwd = _moves(mesh, layout, final, where)
    g0 = partial_to_replicate(final)
    g1 = grad_target(layout, g0) if dst is not None and final != layout else g0
    g2 = partial_to_replicate(layout)
    bwd = _moves(mesh, g0, g1, f"{where} (gradient)") + _moves(mesh, g1, g2, f"{where} (gradient)")
    return _key(fwd, bwd)


def _run(moves: Sequence[Move], x: torch.Tensor) -> torch.Tensor:
    """Apply ``moves`` to the local tensor ``x`` (functional collectives under compile)."""
    if compiling:
        import torch.distributed._functional_collectives as funcol

        for kind, _, _, dim, op, size, rank, group in moves:
            if kind == "all_reduce":
                x = funcol.all_reduce(x, op, group)
            elif kind == "all_gather":
                x = funcol.all_gather_tensor(x, dim % x.ndim, group)
            elif kind == "reduce_scatter":
                x = funcol.reduce_scatter_tensor(x, op, dim % x.ndim, group)
            else:
                x = x.chunk(size, dim)[rank].contiguous()
        return x
    for kind, mesh, axis, dim, op, size, rank, _ in moves:
        if kind == "all_reduce":
            x = collectives.all_reduce(x, mesh, axis, op)  # type: ignore[arg-type]
        elif kind == "all_gather":
            x = torch.cat(collectives.all_gather(x, mesh, axis).unbind(0), dim)
        elif kind == "reduce_scatter":
            stacked = torch.stack(x.chunk(size, dim))
            x = collectives.reduce_scatter(stacked, mesh, axis, op)  # type: ignore[arg-type]
        else:
            x = x.chunk(size, dim)[rank].contiguous()
    return x


def _check_even(moves: Sequence[Move], x: torch.Tensor, where: tuple[Any, str | None]) -> None:
    for kind, _, axis, dim, _, size, _, _ in moves:
        if kind in ("chunk", "reduce_scatter") and (
            not -x.ndim <= dim < x.ndim or x.shape[dim] % size
        ):
            plan, name = where
            raise ValueError(
                f"{plan.owner}: {name}: a plain local tensor of shape {tuple(x.shape)} cannot be split "
                f"evenly on dim {dim} over mesh axis {axis} ({size} ranks) inside an outer "
                "local_map region"
            )


class _Convert(torch.autograd.Function):
    """One declared boundary move of a plain local tensor: forward moves, backward moves."""

    @staticmethod
    def forward(ctx: Any, key: int, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.key = key
        fwd = _conversions[key][0]
        return _run(fwd, x) if fwd else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        bwd = _conversions[ctx.key][1]
        return None, (_run(bwd, grad) if bwd else grad)


def convert(x: torch.Tensor, conversion: Conversion, where: tuple[Any, str | None]) -> torch.Tensor:
    """``x`` moved as ``conversion`` says, with the transposed moves on its gradient.

    ``where`` is ``(the region's plan, the input's name)``, read only to name an error
    (no string is built per call, and a compiled region does not specialise on it).

    Example::

        conv = output_conversion(mesh, (Partial(),), (Replicate(),), "Mlp: output")
        y = convert(y, conv, (plan, "output"))
    """
    key, moves_forward = conversion
    if moves_forward and not compiling:
        _check_even(_conversions[key][0], x, where)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Convert.apply(key, x)  # type: ignore[no-any-return]
    if moves_forward:
        return _run(_conversions[key][0], x)
    return x

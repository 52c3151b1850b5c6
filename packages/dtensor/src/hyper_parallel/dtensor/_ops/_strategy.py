"""Choosing, per mesh axis, the cheapest of an op's valid layouts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._registry import Decision, Declined, LocalFn, OpCall
from hyper_parallel.dtensor._spec import DTensorSpec
from hyper_parallel.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

__all__ = [
    "Candidate",
    "add_once_into_partial",
    "choose",
    "decision_cost",
    "local_bytes",
    "redistribute_cost",
    "skipped_addends",
    "written_outputs",
]

Candidate = tuple[tuple[Placement, ...], tuple[Placement | None, ...]]
"""``(input placements, output placements)`` of one layout on one mesh axis."""


def local_bytes(spec: DTensorSpec) -> float:
    """Approximate bytes of one rank's shard."""
    numel: float = math.prod(spec.shape)
    for axis, p in enumerate(spec.placements):
        if isinstance(p, (Shard, _StridedShard)):
            numel /= spec.mesh.shape[axis]
    return numel * _itemsize(spec)


def _itemsize(spec: DTensorSpec) -> int:
    dtype = spec.tensor_meta.dtype
    return dtype.itemsize if hasattr(dtype, "itemsize") else 4


def redistribute_cost(spec: DTensorSpec, axis: int, src: Placement, dst: Placement) -> float:
    """Bytes a rank sends to move ``spec`` from ``src`` to ``dst`` on ``axis`` (inf: impossible)."""
    if src == dst:
        return 0.0
    if isinstance(dst, Partial):
        return math.inf
    nbytes = local_bytes(spec)
    n = spec.mesh.shape[axis]
    if isinstance(src, (Shard, _StridedShard)):
        return nbytes * (n - 1) if isinstance(dst, Replicate) else nbytes
    if isinstance(src, Partial):
        return 2.0 * nbytes if isinstance(dst, Replicate) else nbytes
    return 1e-3 * nbytes  # a local slice: nearly free, but staying put is preferred


def decision_cost(call: OpCall, decision: Decision) -> float:
    """Bytes a rank sends for a decision: its input moves plus its declared in-kernel reductions.

    An in-kernel all-reduce (``Decision.reduces``) is costed like reducing a Partial
    output to Replicate on that axis, for the largest output: an upper bound (a sharded
    softmax reduces row statistics, far smaller than its output).

    Example::

        decision_cost(call, choose(call, candidates))   # 0.0 when nothing moves
    """
    cost = 0.0
    for spec, target in zip(call.specs, decision.inputs, strict=True):
        for axis, (src, dst) in enumerate(zip(spec.placements, target, strict=True)):
            cost += redistribute_cost(spec, axis, src, dst)
    if decision.reduces:
        largest = 0.0
        for meta, placements in zip(call.out_metas, decision.outputs, strict=True):
            if meta is not None and placements is not None:
                spec = DTensorSpec(call.mesh, tuple(placements), meta)
                largest = max(largest, local_bytes(spec))
        cost += sum(2.0 * largest for axis in decision.reduces if call.mesh.shape[axis] > 1)
    return cost


def written_outputs(call: OpCall) -> list[tuple[int, int | None]]:
    """``(spec index, output index)`` of each DTensor the op writes (self of ``add_``, ``out=``).

    The output index is the result that aliases it (None when no result does).
    """
    schema = call.func._schema
    written_names = [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    if not written_names:
        return []
    names = [a.name for a in schema.arguments]
    index_of: dict[str, int] = {}
    k = 0
    for i, a in enumerate(call.args):
        if isinstance(a, DTensorSpec):
            if i < len(names):
                index_of[names[i]] = k
            k += 1
        elif isinstance(a, (list, tuple)):
            k += sum(1 for v in a if isinstance(v, DTensorSpec))
    for name, v in call.kwargs.items():
        if isinstance(v, DTensorSpec):
            index_of[name] = k
            k += 1
    result: list[tuple[int, int | None]] = []
    for j, name in enumerate(written_names):
        if name in index_of:
            result.append((index_of[name], j if j < len(call.out_metas) else None))
    return result


def choose(
    call: OpCall,
    candidates_for_axis: Callable[[int], Sequence[Candidate]],
    *,
    n_outputs: int | None = None,
) -> Decision:
    """Pick, on every mesh axis independently, the candidate with the least communication.

    Equal bytes go to the candidate with fewer collectives (torch's ``P * P``: one
    all-reduce, not two reduce-scatters), then to the earlier candidate. Outputs given
    as ``None`` are non-tensor.
    """
    mesh = call.mesh
    n_in = len(call.specs)
    n_out = len(call.out_metas) if n_outputs is None else n_outputs
    written = written_outputs(call)
    inputs: list[list[Placement]] = [[] for _ in range(n_in)]
    outputs: list[list[Placement] | None] = [[] for _ in range(n_out)]
    for axis in range(mesh.ndim):
        best: Candidate | None = None
        best_cost = math.inf
        best_moves = 0
        for cand in candidates_for_axis(axis):
            if any(
                cand[0][i] != call.specs[i].placements[axis]
                or (j is not None and cand[1][j] != call.specs[i].placements[axis])
                for i, j in written
            ):
                continue  # an in-place or out= op keeps the layout of the tensor it writes
            cost = 0.0
            moves = 0
            for spec, target in zip(call.specs, cand[0], strict=True):
                step = redistribute_cost(spec, axis, spec.placements[axis], target)
                cost += step
                moves += step > 1e-3 * local_bytes(spec)  # a local slice is no collective
                if cost > best_cost:
                    break
            if cost < best_cost or (cost == best_cost and moves < best_moves):
                best, best_cost, best_moves = cand, cost, moves
        if best is None:
            if written:  # the dispatcher then takes the fallback, which keeps the layout
                raise Declined(
                    f"{call.func}: no layout keeps the placements of the tensor it writes on "
                    f"mesh axis {axis}"
                )
            raise Declined(f"{call.func}: no valid layout on mesh axis {axis}")
        for i, placement in enumerate(best[0]):
            inputs[i].append(placement)
        for j, p in enumerate(best[1]):
            out = outputs[j]
            if out is not None:
                if p is None:
                    outputs[j] = None
                else:
                    out.append(p)
    return Decision(
        [tuple(i) for i in inputs],
        [tuple(o) if o is not None else None for o in outputs],
    )


def add_once_into_partial(
    call: OpCall, decision: Decision, addends: Sequence[tuple[int, int]]
) -> LocalFn | None:
    """The local op for a Partial("sum") result that takes Replicate ``addends`` unchanged.

    ``addends`` lists ``(spec index, positional argument index)``. Summed over a
    Partial("sum") axis, a Replicate addend would count once per rank; so only the
    axis's first rank adds it (torch divides it by the axis size instead). Returns
    ``None`` where this rank adds every addend (the op itself then runs).
    """
    zeroed = [position for i, position in addends if i in skipped_addends(call, decision)]
    if not zeroed:
        return None
    func = call.func

    def local(*args: Any, **kwargs: Any) -> Any:
        swapped = [torch.zeros_like(a) if k in zeroed else a for k, a in enumerate(args)]
        return func(*swapped, **kwargs)

    return local


def skipped_addends(call: OpCall, decision: Decision) -> frozenset[int]:
    """The spec indices of Replicate inputs this rank leaves out of a Partial("sum") result.

    A Replicate input summed over a Partial("sum") axis would count once per rank, so
    only the axis's first rank takes it; the others take zeros (see
    :func:`add_once_into_partial`).

    Example::

        skipped_addends(call, decision)   # frozenset({1}) off the first rank of a P + R
    """
    coordinate = call.mesh.get_coordinate()
    out = decision.outputs[0]
    if coordinate is None or out is None:
        return frozenset()
    return frozenset(
        i
        for i, placements in enumerate(decision.inputs)
        if any(
            out[axis] == Partial("sum")
            and isinstance(placements[axis], Replicate)
            and coordinate[axis] != 0
            for axis in range(call.mesh.ndim)
        )
    )

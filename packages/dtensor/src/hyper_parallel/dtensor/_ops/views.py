"""Sharding rules of view and shape ops: view, expand, permute, transpose, squeeze, slicing, cat."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._ops._strategy import (
    Candidate,
    add_once_into_partial,
    choose,
    skipped_addends,
)
from hyper_parallel.dtensor._ops.strided_views import strided_view_placement
from hyper_parallel.dtensor._registry import Decision, Declined, OpCall, register_rule
from hyper_parallel.dtensor._spec import DTensorSpec, chunk_bounds, local_shape_and_offset
from hyper_parallel.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

aten = torch.ops.aten
_R = Replicate()


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _map_dims(call: OpCall, dim_map: Sequence[int | None], out_count: int = 1) -> Decision:
    """Each axis: Shard(d) -> Shard(dim_map[d]), or Replicate where ``dim_map[d]`` is None."""
    spec = call.specs[0]
    ins: list[Placement] = []
    outs: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Shard):
            target = dim_map[p.dim]
            if target is None:
                ins.append(_R)
                outs.append(_R)
            else:
                ins.append(p)
                outs.append(Shard(target))
        else:
            ins.append(p)
            outs.append(p)
    return Decision([tuple(ins)], [tuple(outs)] * out_count)


def view_groups(
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    singletons: list[tuple[int, int]] | None = None,
) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims skipped).

    ``singletons``, when given, receives the ``(input dim, output dim)`` pairs of size-1
    dims met at the same point of both shapes (``(1, 2, 2, 2) -> (1, 2, 4)``: ``(0, 0)``).
    """
    if 0 in in_shape or 0 in out_shape:
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while True:
        while (i < n_in and in_shape[i] == 1) or (j < n_out and out_shape[j] == 1):
            if i < n_in and in_shape[i] == 1 and j < n_out and out_shape[j] == 1:
                if singletons is not None:
                    singletons.append((i, j))
                i += 1
                j += 1
            elif i < n_in and in_shape[i] == 1:
                i += 1
            else:
                j += 1
        if i == n_in and j == n_out:
            return groups
        if i == n_in or j == n_out:
            return None
        in_g, out_g = [i], [j]
        p_in, p_out = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while p_in != p_out:
            if p_in < p_out:
                if i == n_in:
                    return None
                in_g.append(i)
                p_in *= in_shape[i]
                i += 1
            else:
                if j == n_out:
                    return None
                out_g.append(j)
                p_out *= out_shape[j]
                j += 1
        groups.append((in_g, out_g))


def _view_dim_map(spec: DTensorSpec, out_shape: tuple[int, ...]) -> list[int | None]:
    """Where each input dim's shard lands in a view to ``out_shape`` (None: it cannot)."""
    in_shape = spec.shape
    dim_map: list[int | None] = [None] * len(in_shape)
    singletons: list[tuple[int, int]] = []
    groups = view_groups(in_shape, out_shape, singletons)
    if groups is None:
        return dim_map
    # a shard of a size-1 dim (the first coordinate holds it, the others are empty) is
    # the same shard of the size-1 output dim it meets: no data moves, as torch
    for d, o in singletons:
        dim_map[d] = o
    mesh_shape = spec.mesh.shape
    for in_g, out_g in groups:
        d, o = in_g[0], out_g[0]
        inner_in = math.prod(in_shape[k] for k in in_g[1:])
        inner_out = math.prod(out_shape[k] for k in out_g[1:])
        axes = [a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == d]
        if not axes:
            continue
        if len(axes) == 1:
            n = mesh_shape[axes[0]]
            ok = [b * inner_in for b in chunk_bounds(in_shape[d], n)] == [
                b * inner_out for b in chunk_bounds(out_shape[o], n)
            ]
        else:
            total = math.prod(mesh_shape[a] for a in axes)
            ok = in_shape[d] % total == 0 and out_shape[o] % total == 0
        if ok:
            dim_map[d] = o
    return dim_map


def _local_shape_rewrite(
    args: Sequence[Any], kwargs: dict[str, Any], out_shapes: list[tuple[int, ...] | None]
) -> tuple[Sequence[Any], dict[str, Any]]:
    return (args[0], list(out_shapes[0] or ()), *args[2:]), kwargs


def _view_to(shape: list[int]) -> Any:
    """The local op of a view: ``x.view(shape)`` (``shape``: the local shard's, fixed per plan).

    When the local layout cannot be viewed so, a copy: the global strides a DTensor
    reports come from the op on meta tensors, and its local shard can be laid out
    differently (a redistribution returns a fresh contiguous tensor, a kernel's output
    layout can follow its input's). The values are the same either way.
    """

    def view(x: torch.Tensor, *args: Any) -> torch.Tensor:
        try:
            return x.view(shape)
        except RuntimeError:
            return x.reshape(shape)

    return view


def _view_rule(call: OpCall) -> Decision:
    out_meta = call.out_metas[0]
    assert out_meta is not None
    spec = call.specs[0]
    dim_map = _view_dim_map(spec, out_meta.shape)
    if any(
        isinstance(p, _StridedShard) or (isinstance(p, Shard) and dim_map[p.dim] is None)
        for p in spec.placements
    ):
        decision = _strided_view(call, dim_map, out_meta.shape)
    else:
        decision = _map_dims(call, dim_map)
    mesh = call.mesh
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    placements = decision.outputs[0]
    assert placements is not None
    local, _ = local_shape_and_offset(out_meta.shape, mesh.shape, coordinate, placements)
    decision.local_fn = _view_to(list(local))
    return decision


def _strided_view(call: OpCall, dim_map: list[int | None], out_shape: tuple[int, ...]) -> Decision:
    """A view whose shards only a strided placement keeps (``strided_views``); others gathered."""
    spec = call.specs[0]
    groups = view_groups(spec.shape, out_shape)
    if groups is None:
        if not any(isinstance(p, _StridedShard) for p in spec.placements):
            return _map_dims(call, dim_map)
        # the planner then shows the strided axes as Replicate (they move)
        raise Declined(f"{call.func}: a view of {spec.shape} as {out_shape} of strided shards")
    ins: list[Placement] = []
    outs: list[Placement] = []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard) and dim_map[p.dim] is not None:
            kept: Placement | None = Shard(dim_map[p.dim])  # type: ignore[arg-type]
        else:
            kept = strided_view_placement(spec, out_shape, groups, axis)
        ins.append(_R if kept is None else p)
        outs.append(_R if kept is None else kept)
    return Decision([tuple(ins)], [tuple(outs)])


def _expand_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    out_meta = call.out_metas[0]
    assert out_meta is not None
    offset = len(out_meta.shape) - spec.ndim
    dim_map: list[int | None] = [
        d + offset if spec.shape[d] == out_meta.shape[d + offset] else None
        for d in range(spec.ndim)
    ]
    decision = _map_dims(call, dim_map)
    decision.rewrite = _local_shape_rewrite
    return decision


def _permute_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dims = [_norm_dim(d, spec.ndim) for d in call.args[1]]
    inverse = [0] * spec.ndim
    for k, d in enumerate(dims):
        inverse[d] = k
    return _map_dims(call, list(inverse))


def _transpose_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    if call.func.overloadpacket in (aten.t, aten.t_):
        d0, d1 = (0, 1) if spec.ndim == 2 else (0, 0)
    else:
        d0, d1 = _norm_dim(call.args[1], spec.ndim), _norm_dim(call.args[2], spec.ndim)
    dim_map: list[int | None] = list(range(spec.ndim))
    if spec.ndim:
        dim_map[d0], dim_map[d1] = d1, d0
    return _map_dims(call, dim_map)


def _unsqueeze_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    d = _norm_dim(call.args[1], spec.ndim + 1)
    return _map_dims(call, [k if k < d else k + 1 for k in range(spec.ndim)])


def _squeeze_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    if len(call.args) > 1:
        raw = call.args[1]
        dims = [raw] if isinstance(raw, int) else list(raw)
        squeezed = {
            _norm_dim(d, spec.ndim) for d in dims if spec.shape[_norm_dim(d, spec.ndim)] == 1
        }
    else:
        squeezed = {d for d in range(spec.ndim) if spec.shape[d] == 1}
    dim_map: list[int | None] = []
    removed = 0
    for d in range(spec.ndim):
        if d in squeezed:
            dim_map.append(None)
            removed += 1
        else:
            dim_map.append(d - removed)
    return _map_dims(call, dim_map)


def _keep_unless_dim(call: OpCall, dim: int, *, drop: bool, out_count: int = 1) -> Decision:
    """Layouts survive, except a shard of ``dim`` (which is replicated); ``drop`` removes ``dim``."""
    spec = call.specs[0]
    dim_map: list[int | None] = []
    for d in range(spec.ndim):
        if d == dim:
            dim_map.append(None)
        else:
            dim_map.append(d - 1 if drop and d > dim else d)
    decision = _map_dims(call, dim_map, out_count)
    # every other DTensor argument (e.g. an index) is needed whole
    for _ in call.specs[1:]:
        decision.inputs.append((_R,) * call.mesh.ndim)
    return decision


def _slice_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    args = [*call.args, None, None, None, None][1:5]
    dim = _norm_dim(args[0] if args[0] is not None else call.kwargs.get("dim", 0), spec.ndim)
    start, end, step = args[1], args[2], args[3]
    whole = (start in (None, 0)) and (end is None or end >= spec.shape[dim]) and step in (None, 1)
    if whole:  # x[:, :] and friends: nothing moves
        return _map_dims(call, list(range(spec.ndim)))
    return _keep_unless_dim(call, dim, drop=False)


def _select_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    return _keep_unless_dim(call, _norm_dim(call.args[1], spec.ndim), drop=True)


def _split_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    return _keep_unless_dim(
        call, _norm_dim(dim, spec.ndim), drop=False, out_count=len(call.out_metas)
    )


def _unbind_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    return _keep_unless_dim(
        call, _norm_dim(dim, spec.ndim), drop=True, out_count=len(call.out_metas)
    )


def _index_select_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    return _keep_unless_dim(call, _norm_dim(call.args[1], spec.ndim), drop=False)


def _slice_backward_rule(call: OpCall) -> Decision:
    """slice_backward(grad, input_sizes, dim, ...): zeros around the slice; dims other than
    ``dim`` keep their shards (with the local input sizes), Partial stays Partial."""
    spec = call.specs[0]
    dim = _norm_dim(call.args[2], spec.ndim)
    decision = _map_dims(call, [None if d == dim else d for d in range(spec.ndim)])
    decision.rewrite = _local_shape_rewrite
    return decision


def _select_backward_rule(call: OpCall) -> Decision:
    """select_backward(grad, input_sizes, dim, index): grad dims map around the inserted ``dim``."""
    spec = call.specs[0]
    dim = _norm_dim(call.args[2], spec.ndim + 1)
    decision = _map_dims(call, [d if d < dim else d + 1 for d in range(spec.ndim)])
    decision.rewrite = _local_shape_rewrite
    return decision


def _index_dims(
    self_ndim: int, indices: Sequence[Any], out_ndim: int
) -> tuple[list[int | None], int, int] | None:
    """For ``self[indices]`` (advanced indexing): where each dim of ``self`` lands in the
    output (None: indexed), the output dim where the broadcast index dims start, and how
    many there are. None when an index is not a tensor index (e.g. a boolean mask)."""
    positions = [i for i, t in enumerate(indices) if t is not None]
    if not positions:
        return None
    for i in positions:
        t = indices[i]
        dtype = t.tensor_meta.dtype if isinstance(t, DTensorSpec) else getattr(t, "dtype", None)
        if dtype is None or dtype in (torch.bool, torch.uint8):
            return None
    n_index = out_ndim - (self_ndim - len(positions))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    dim_map: list[int | None] = []
    for d in range(self_ndim):
        if d in positions:
            dim_map.append(None)
        elif adjacent:
            dim_map.append(d if d < start else d - len(positions) + n_index)
        else:
            dim_map.append(n_index + sum(1 for k in range(d) if k not in positions))
    return dim_map, start, n_index


def _index_rule(call: OpCall) -> Decision | None:
    """``self[..., idx]``: non-indexed dims of ``self`` keep their shards (indices replicated);
    a shard of the indices lands on the output's index dims (``self`` replicated)."""
    spec = call.specs[0]
    indices = call.args[1]
    out_meta = call.out_metas[0]
    assert out_meta is not None
    found = _index_dims(spec.ndim, indices, len(out_meta.shape))
    if found is None:
        return None
    dim_map, start, n_index = found
    index_specs = [t for t in indices if isinstance(t, DTensorSpec)]  # a plain one: replicated
    index_shape = out_meta.shape[start : start + n_index]

    def candidates(axis: int) -> list[Candidate]:
        n_idx = len(index_specs)
        cands: list[Candidate] = []
        for d, o in enumerate(dim_map):
            if o is not None:
                cands.append(((Shard(d),) + (_R,) * n_idx, (Shard(o),)))
        for j in range(n_index):
            ins: list[Placement] = [_R]
            for t in index_specs:
                k = j - (n_index - t.ndim)
                ins.append(Shard(k) if k >= 0 and t.shape[k] == index_shape[j] else _R)
            cands.append((tuple(ins), (Shard(start + j),)))
        p = spec.placements[axis]
        if isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            cands.append(((p,) + (_R,) * n_idx, (p,)))
        cands.append(((_R,) * (1 + n_idx), (_R,)))
        return cands

    return choose(call, candidates)


def _index_put_rule(call: OpCall) -> Decision | None:
    """``self[indices] = values`` (or ``+=``): non-indexed dims of ``self`` keep their shards
    with ``values`` sharded alike; Partial values into a Partial ``self`` of the same reduce op
    stay Partial (the op is linear in both), as torch. A 0-dim plain index is replicated."""
    spec = call.specs[0]
    indices = call.args[1]
    has_values = isinstance(call.args[2], DTensorSpec)  # else a 0-dim plain tensor
    values = call.specs[-1]
    accumulate = (
        bool(call.args[3]) if len(call.args) > 3 else bool(call.kwargs.get("accumulate", False))
    )
    given = [t for t in indices if t is not None]
    if not given or any(not isinstance(t, (DTensorSpec, torch.Tensor)) for t in given):
        return None
    index_specs = [t for t in given if isinstance(t, DTensorSpec)]
    # the shape self[indices] has: the index dims broadcast, placed as in _index_rule
    index_ndim = max(t.ndim for t in given)
    result_ndim = spec.ndim - len(given) + index_ndim
    found = _index_dims(spec.ndim, indices, result_ndim)
    if found is None:
        return None
    dim_map = found[0]
    n_idx = len(index_specs)
    n_in = len(call.specs)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for d, o in enumerate(dim_map):
            if o is None:
                continue
            ins: tuple[Placement, ...] = (Shard(d),) + (_R,) * n_idx
            if has_values:
                k = o - (result_ndim - values.ndim)
                ins += (Shard(k) if k >= 0 and values.shape[k] == spec.shape[d] else _R,)
            cands.append((ins, (Shard(d),)))
        p = spec.placements[axis]
        if has_values and isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            cands.append(((p,) + (_R,) * n_idx + (p,), (p,)))
        if accumulate and has_values and p == Partial("sum"):
            # replicated values accumulated into a Partial sum: added once, no communication
            cands.append(((p,) + (_R,) * n_idx + (_R,), (p,)))
        cands.append(((_R,) * n_in, (_R,)))
        return cands

    decision = choose(call, candidates)
    if accumulate and has_values:
        decision.local_fn = add_once_into_partial(call, decision, [(n_in - 1, 2)])
    return decision


def _gather_scatter_rule(call: OpCall) -> Decision:
    """gather / scatter / scatter_add along ``dim``: every other dim may be sharded where all
    tensors have the same size there; a Partial sum passes through (these ops are linear).

    ``gather`` also keeps, as torch: a shard of the index on any dim (``self`` replicated:
    each rank gathers its rows of the output), and a shard of ``self`` along ``dim`` when the
    index has size 1 there (each rank gathers the entries it holds, zeros elsewhere: a
    Partial sum, torch's mask-partial path).
    """
    spec = call.specs[0]
    dim = _norm_dim(call.args[1], spec.ndim)
    n_in = len(call.specs)
    out_meta = call.out_metas[0]
    assert out_meta is not None
    gather = call.func.overloadpacket is aten.gather and n_in == 2
    # scatter.value writes the same number on every rank: not linear
    linear = not (call.func.overloadpacket in (aten.scatter, aten.scatter_) and n_in == 2)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for d in range(spec.ndim):
            if d != dim and all(s.shape[d] == out_meta.shape[d] for s in call.specs):
                cands.append(((Shard(d),) * n_in, (Shard(d),)))
        if gather:
            cands += [((_R, Shard(d)), (Shard(d),)) for d in range(spec.ndim)]
            if call.specs[1].shape[dim] == 1:
                cands.append(((Shard(dim), _R), (Partial(),)))
        p = spec.placements[axis]
        if linear and isinstance(p, Partial) and p.reduce_op == "sum":
            # the index (second DTensor) is replicated; values sum across ranks
            ins = tuple(_R if k == 1 else p for k in range(n_in))
            cands.append((ins, (p,)))
        cands.append(((_R,) * n_in, (_R,)))
        return cands

    decision = choose(call, candidates)
    if gather and Shard(dim) in decision.inputs[0]:
        coordinate = call.mesh.get_coordinate() or [0] * call.mesh.ndim
        shape, offset = local_shape_and_offset(
            spec.shape, call.mesh.shape, coordinate, decision.inputs[0]
        )
        decision.local_fn = _masked_gather(offset[dim], shape[dim])
    return decision


def _masked_gather(start: int, length: int) -> Any:
    """gather from the shard ``[start, start + length)`` of ``dim``: zeros where another rank
    holds the entry (summed across ranks later)."""

    def gather(x: torch.Tensor, dim: int, index: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        shifted = index - start
        outside = (shifted < 0) | (shifted >= length)
        if length == 0:  # an empty shard (uneven): it holds no entry
            return x.new_zeros(index.shape)
        picked = torch.gather(x, dim, shifted.masked_fill(outside, 0), **kwargs)
        return picked.masked_fill(outside, 0)

    return gather


def _index_add_rule(call: OpCall) -> Decision:
    """index_add(self, dim, index, source): other dims shard alike (the 1-D index replicated);
    a Partial sum of ``self`` and ``source`` stays Partial."""
    spec = call.specs[0]
    dim = _norm_dim(call.args[1], spec.ndim)
    source = call.specs[2]

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = [
            ((Shard(d), _R, Shard(d)), (Shard(d),))
            for d in range(spec.ndim)
            if d != dim and source.ndim == spec.ndim and source.shape[d] == spec.shape[d]
        ]
        p = spec.placements[axis]
        if isinstance(p, Partial) and p.reduce_op == "sum":
            cands.append(((p, _R, p), (p,)))
        cands.append(((_R, _R, _R), (_R,)))
        return cands

    return choose(call, candidates)


def _cat_rule(call: OpCall) -> Decision:
    out_meta = call.out_metas[0]
    assert out_meta is not None
    stack = call.func.overloadpacket is aten.stack
    ndim_in = call.specs[0].ndim
    raw_dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    dim = _norm_dim(raw_dim, ndim_in + 1 if stack else ndim_in)
    n = len(call.specs)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for d in range(ndim_in):
            if d == dim and not stack:
                continue
            out_d = d + 1 if stack and d >= dim else d
            cands.append(((Shard(d),) * n, (Shard(out_d),)))
        partials = {p for s in call.specs if isinstance(p := s.placements[axis], Partial)}
        for p in partials:
            if p.reduce_op in ("sum", "avg"):
                # a Replicate input joins a Partial sum or mean without communication, as
                # torch: as it is for avg, from the axis's first rank only for sum
                cands.append(
                    (tuple(p if s.placements[axis] == p else _R for s in call.specs), (p,))
                )
            else:
                cands.append(((p,) * n, (p,)))
        cands.append(((_R,) * n, (_R,)))
        return cands

    if any(s.ndim != ndim_in for s in call.specs):
        return None  # type: ignore[return-value]
    decision = choose(call, candidates)
    skipped = skipped_addends(call, decision)
    if skipped:
        decision.local_fn = _cat_without(call.func, skipped)
    return decision


def _cat_without(func: Any, skipped: frozenset[int]) -> Any:
    """cat / stack with the tensors at ``skipped`` replaced by zeros (Replicate into a Partial sum)."""

    def local(tensors: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        parts = [torch.zeros_like(t) if i in skipped else t for i, t in enumerate(tensors)]
        return func(parts, *args, **kwargs)

    return local


register_rule(aten.view.default, aten._unsafe_view.default)(_view_rule)
register_rule(aten.expand.default)(_expand_rule)
register_rule(aten.permute.default)(_permute_rule)
register_rule(aten.transpose.int, aten.t.default)(_transpose_rule)
register_rule(aten.unsqueeze.default)(_unsqueeze_rule)
register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)(_squeeze_rule)
register_rule(aten.slice.Tensor)(_slice_rule)
register_rule(aten.select.int)(_select_rule)
register_rule(aten.split.Tensor, aten.split_with_sizes.default)(_split_rule)
register_rule(aten.unbind.int)(_unbind_rule)
register_rule(aten.index_select.default)(_index_select_rule)
register_rule(aten.cat.default, aten.stack.default)(_cat_rule)
register_rule(aten.slice_backward.default)(_slice_backward_rule)
register_rule(aten.select_backward.default)(_select_backward_rule)
register_rule(aten.index.Tensor)(_index_rule)
register_rule(aten.index_add.default, aten.index_add_.default)(_index_add_rule)
register_rule(
    aten.gather.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter_.src,
    aten.scatter_.value,
    aten.scatter_add.default,
    aten.scatter_add_.default,
)(_gather_scatter_rule)
register_rule(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)(
    _index_put_rule
)

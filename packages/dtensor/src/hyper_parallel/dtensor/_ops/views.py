"""Sharding rules of view and shape ops: view, expand, permute, transpose, squeeze, slicing, cat."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._dispatch import Decision, OpCall, register_rule
from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._spec import DTensorSpec, chunk_bounds
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

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
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims skipped)."""
    if 0 in in_shape or 0 in out_shape:
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while True:
        while i < n_in and in_shape[i] == 1:
            i += 1
        while j < n_out and out_shape[j] == 1:
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
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        return dim_map
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
    args: tuple[Any, ...], kwargs: dict[str, Any], out_shapes: list[tuple[int, ...] | None]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (args[0], list(out_shapes[0] or ()), *args[2:]), kwargs


def _view_rule(call: OpCall) -> Decision:
    out_meta = call.out_metas[0]
    assert out_meta is not None
    decision = _map_dims(call, _view_dim_map(call.specs[0], out_meta.shape))
    decision.rewrite = _local_shape_rewrite
    return decision


def _expand_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    out_meta = call.out_metas[0]
    assert out_meta is not None
    offset = len(out_meta.shape) - spec.ndim
    dim_map: list[int | None] = [
        d + offset if spec.shape[d] == out_meta.shape[d + offset] else None for d in range(spec.ndim)
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
        squeezed = {_norm_dim(d, spec.ndim) for d in dims if spec.shape[_norm_dim(d, spec.ndim)] == 1}
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
    return _keep_unless_dim(call, _norm_dim(dim, spec.ndim), drop=False, out_count=len(call.out_metas))


def _unbind_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    return _keep_unless_dim(call, _norm_dim(dim, spec.ndim), drop=True, out_count=len(call.out_metas))


def _index_select_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    return _keep_unless_dim(call, _norm_dim(call.args[1], spec.ndim), drop=False)


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
        partials = {s.placements[axis] for s in call.specs if isinstance(s.placements[axis], Partial)}
        for p in partials:
            cands.append(((p,) * n, (p,)))
        cands.append(((_R,) * n, (_R,)))
        return cands

    if any(s.ndim != ndim_in for s in call.specs):
        return None  # type: ignore[return-value]
    return choose(call, candidates)


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

"""Sharding rules of reductions: sum, mean, amax/amin, max/min, var/std, vector norms, softmax."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._loss_parallel import loss_parallel_active
from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor.collectives import all_reduce_over
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

Over = tuple[DeviceMesh, tuple[int, ...]]
"""The mesh axes an in-kernel reduction runs over."""

aten = torch.ops.aten
_R = Replicate()

# op packet -> the Partial its local results form when a reduced dim is sharded (None: replicate)
_PARTIAL_OF: dict[Any, str | None] = {
    aten.sum: "sum",
    aten.mean: "sum",  # computed as a local sum over the global count
    aten.amax: "max",
    aten.amin: "min",
    aten.prod: "product",
    aten.max: "max",
    aten.min: "min",
    aten.var: None,
    aten.std: None,
    aten.var_mean: None,
    aten.std_mean: None,
    aten.argmax: None,
    aten.argmin: None,
    aten.any: "max",
    aten.all: "min",
}
# which input Partials pass through unchanged
_KEEPS_PARTIAL = {
    aten.sum: ("sum", "avg"),
    aten.mean: ("sum", "avg"),
    aten.amax: ("max",),
    aten.amin: ("min",),
    aten.prod: ("product",),
    aten.max: ("max",),
    aten.min: ("min",),
}


def _reduced_dims(call: OpCall, ndim: int) -> tuple[list[int], bool]:
    """The reduced dims and keepdim of a reduction call."""
    args = call.args
    dim: Any = None
    keepdim = False
    if len(args) > 1 and not isinstance(args[1], torch.dtype):
        dim = args[1]
        if len(args) > 2 and isinstance(args[2], bool):
            keepdim = args[2]
    dim = call.kwargs.get("dim", dim)
    keepdim = call.kwargs.get("keepdim", keepdim)
    if call.func._schema.overload_name in ("correction", "correction_names") and len(args) > 3:
        keepdim = bool(args[3])
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim)), bool(keepdim)
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d + ndim if d < 0 else d for d in dims}), bool(keepdim)


def _out_dim(d: int, reduced: Sequence[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in reduced if r < d)


def _reduction_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    packet = call.func.overloadpacket
    reduced, keepdim = _reduced_dims(call, spec.ndim)
    n_out = len(call.out_metas)
    with_indices = n_out > 1  # max.dim / min.dim: an index needs the whole reduced dim
    partial_op = None if with_indices else _PARTIAL_OF.get(packet)
    keeps = () if with_indices else _KEEPS_PARTIAL.get(packet, ())
    ins: list[Placement] = []
    outs: list[Placement] = []
    sharded_reduced = False
    for p in spec.placements:
        if isinstance(p, Shard):
            if p.dim in reduced:
                if partial_op is None:
                    ins.append(_R)
                    outs.append(_R)
                else:
                    ins.append(p)
                    outs.append(Partial(partial_op))  # type: ignore[arg-type]
                    sharded_reduced = True
            else:
                ins.append(p)
                outs.append(Shard(_out_dim(p.dim, reduced, keepdim)))
        elif isinstance(p, Partial):
            if p.reduce_op in keeps:
                ins.append(p)
                outs.append(p)
            else:
                ins.append(_R)
                outs.append(_R)
        else:
            ins.append(p)
            outs.append(p)
    decision = Decision([tuple(ins)], [tuple(outs)] * n_out)
    if sharded_reduced and packet is aten.mean:
        count = math.prod(spec.shape[d] for d in reduced)
        decision.local_fn = _mean_as_sum(count)
    elif sharded_reduced and partial_op in ("max", "min"):
        decision.local_fn = _extreme_of_maybe_empty(call.func, partial_op, reduced, keepdim)
    return decision


def _extreme_of_maybe_empty(func: Any, op: str, reduced: list[int], keepdim: bool) -> Any:
    """amax/amin/max/min whose local shard may be empty (uneven shards): an empty shard gives
    the identity of the reduction (-inf for max), which never wins the all-reduce."""

    def local(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.numel():
            return func(x, *args, **kwargs)  # type: ignore[no-any-return]
        identity: float | int | bool
        if x.dtype.is_floating_point:
            identity = float("-inf") if op == "max" else float("inf")
        elif x.dtype == torch.bool:
            identity = op == "min"
        else:
            info = torch.iinfo(x.dtype)
            identity = info.min if op == "max" else info.max
        shape = [1 if d in reduced else size for d, size in enumerate(x.shape)]
        if not keepdim:
            shape = [size for d, size in enumerate(shape) if d not in reduced]
        return x.new_full(shape, identity)

    return local


def _mean_as_sum(count: int) -> Any:
    def local_mean(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or "dim" in kwargs:
            dim = kwargs.pop("dim", args[0] if args else None)
            keepdim = kwargs.pop("keepdim", args[1] if len(args) > 1 else False)
            dtype = kwargs.pop("dtype", args[2] if len(args) > 2 else None)
            total = torch.sum(x, dim=dim, keepdim=keepdim, dtype=dtype)
        else:
            total = torch.sum(x, dtype=kwargs.get("dtype"))
        return total / count

    return local_mean


def _norm_rule(call: OpCall) -> Decision:
    """linalg_vector_norm: shards of reduced dims combine with one all-reduce of |x|^p sums."""
    spec = call.specs[0]
    args = call.args
    ord_ = args[1] if len(args) > 1 else call.kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else call.kwargs.get("dim", None)
    keepdim = args[3] if len(args) > 3 else call.kwargs.get("keepdim", False)
    ndim = spec.ndim
    reduced = (
        list(range(ndim))
        if dim is None or dim == []
        else sorted({d + ndim if d < 0 else d for d in ([dim] if isinstance(dim, int) else dim)})
    )
    ins: list[Placement] = []
    outs: list[Placement] = []
    sum_axes: list[int] = []
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim in reduced:
                ins.append(p)
                outs.append(_R)
                sum_axes.append(axis)
            else:
                ins.append(p)
                outs.append(Shard(_out_dim(p.dim, reduced, bool(keepdim))))
        elif isinstance(p, Partial):
            ins.append(_R)
            outs.append(_R)
        else:
            ins.append(p)
            outs.append(p)
    decision = Decision([tuple(ins)], [tuple(outs)])
    if sum_axes and (float(ord_) > 0):
        over = (spec.mesh, tuple(sum_axes))
        decision.local_fn = _sharded_norm(float(ord_), over)
        decision.reduces = tuple(sum_axes)
    elif sum_axes:
        return None  # type: ignore[return-value]
    return decision


def _sharded_norm(ord_: float, over: Over) -> Any:
    def local_norm(
        x: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
    ) -> torch.Tensor:
        del ord
        xs = x if dtype is None else x.to(dtype)
        dims = dim if dim is not None else ()
        if math.isinf(ord_):
            # max |x|; an empty shard contributes 0, which never beats a real |x|
            part = (
                xs.abs().amax(dim=dims, keepdim=keepdim)
                if xs.numel()
                else xs.abs().sum(dim=dims, keepdim=keepdim)
            )
            return all_reduce_over(part, *over, "max")
        powered = torch.sum(xs.abs() ** ord_, dim=dims, keepdim=keepdim)
        powered = all_reduce_over(powered, *over, "sum")
        return powered ** (1.0 / ord_)

    return local_norm


def _softmax_rule(call: OpCall) -> Decision:
    """softmax / log_softmax and their backwards, over any layout.

    Dims other than the softmax dim shard freely. A shard of the softmax dim stays
    sharded: the kernel all-reduces the row max and the sum of exponentials (forward)
    or the row sum of the gradient (backward) across the axes that split it, so a
    vocab-sharded output projection never gathers its logits (loss parallel).
    """
    backward = call.func.overloadpacket in (
        aten._softmax_backward_data,
        aten._log_softmax_backward_data,
    )
    spec = call.specs[0]
    ndim = spec.ndim
    raw_dim = call.args[2] if backward else call.args[1]
    dim = raw_dim + ndim if raw_dim < 0 else raw_dim
    n_in = len(call.specs)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = [((Shard(d),) * n_in, (Shard(d),)) for d in range(ndim)]
        cands.append(((_R,) * n_in, (_R,)))
        return cands

    decision = choose(call, candidates)
    axes = [a for a, p in enumerate(decision.inputs[0]) if isinstance(p, Shard) and p.dim == dim]
    if axes:
        over = (call.mesh, tuple(axes))
        packet = call.func.overloadpacket
        decision.local_fn = _SHARDED_SOFTMAX[packet](over)
        decision.reduces = tuple(axes)
    return decision


def _all_reduce(t: torch.Tensor, over: Over, op: Any) -> torch.Tensor:
    return all_reduce_over(t, *over, op)


def _row_max(x: torch.Tensor, dim: int, over: Over) -> torch.Tensor:
    if x.shape[dim] == 0:  # an empty shard: -inf never wins the max
        shape = list(x.shape)
        shape[dim] = 1
        local = x.new_full(shape, float("-inf"))
    else:
        local = x.amax(dim, keepdim=True)
    return _all_reduce(local, over, "max")


def _sharded_log_softmax(over: Over) -> Any:
    def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        if half_to_float:
            x = x.float()
        shifted = x - _row_max(x, dim, over)
        total = _all_reduce(shifted.exp().sum(dim, keepdim=True), over, "sum")
        return shifted - total.log()

    return log_softmax


def _sharded_softmax(over: Over) -> Any:
    def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        if half_to_float:
            x = x.float()
        e = (x - _row_max(x, dim, over)).exp()
        return e / _all_reduce(e.sum(dim, keepdim=True), over, "sum")

    return softmax


def _sharded_safe_softmax(over: Over) -> Any:
    """``_safe_softmax`` (attention's math form): a row masked everywhere gives zeros, not NaN."""

    def safe_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is not None:
            x = x.to(dtype)
        row_max = _row_max(x, dim, over)
        row_max = torch.where(torch.isneginf(row_max), 0, row_max)
        e = (x - row_max).exp()
        total = _all_reduce(e.sum(dim, keepdim=True), over, "sum")
        return torch.where(total == 0, 0, e / total)

    return safe_softmax


def _sharded_log_softmax_backward(over: Over) -> Any:
    def backward(
        grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype
    ) -> torch.Tensor:
        if loss_parallel_active():
            # nll_loss's fused backward already gave the logits' gradient (see losses.py)
            return grad.to(input_dtype)
        total = _all_reduce(grad.sum(dim, keepdim=True), over, "sum")
        return (grad - out.exp() * total).to(input_dtype)

    return backward


def _sharded_softmax_backward(over: Over) -> Any:
    def backward(
        grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype
    ) -> torch.Tensor:
        total = _all_reduce((grad * out).sum(dim, keepdim=True), over, "sum")
        return (out * (grad - total)).to(input_dtype)

    return backward


_SHARDED_SOFTMAX: dict[Any, Callable[[Over], Any]] = {
    aten._log_softmax: _sharded_log_softmax,
    aten._softmax: _sharded_softmax,
    aten._safe_softmax: _sharded_safe_softmax,
    aten._log_softmax_backward_data: _sharded_log_softmax_backward,
    aten._softmax_backward_data: _sharded_softmax_backward,
}


register_rule(
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.prod.default,
    aten.prod.dim_int,
    aten.max.default,
    aten.min.default,
    aten.max.dim,
    aten.min.dim,
    aten.argmax.default,
    aten.argmin.default,
    aten.var.correction,
    aten.std.correction,
    aten.var_mean.correction,
    aten.std_mean.correction,
    aten.any.default,
    aten.any.dim,
    aten.any.dims,
    aten.all.default,
    aten.all.dim,
    aten.all.dims,
)(_reduction_rule)
register_rule(aten.linalg_vector_norm.default)(_norm_rule)
register_rule(
    aten._softmax.default,
    aten._safe_softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
)(_softmax_rule)


def _dist_rule(call: OpCall) -> Decision | None:
    """``dist(a, b, p)``, the p-norm of ``a - b``, of like-shaped inputs sharded alike.

    As torch's: ``p=1`` (a sum of ``|a - b|``) gives a ``Partial("sum")`` and ``p=inf`` (a
    max) a ``Partial("max")`` over the sharding axes, with no communication. Other ``p > 0``
    come out Replicate with one all-reduce of the local ``sum |a - b|^p`` (as ``vector_norm``,
    where torch keeps a lazy norm-Partial); ``p <= 0`` declines (the fallback).
    """
    p = float(call.args[2] if len(call.args) > 2 else call.kwargs.get("p", 2))
    if len(call.specs) != 2 or call.specs[0].shape != call.specs[1].shape or not p > 0:
        return None
    ndim = call.specs[0].ndim
    of_shards: Placement = Partial("sum") if p == 1 else Partial("max") if math.isinf(p) else _R

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = [((Shard(d), Shard(d)), (of_shards,)) for d in range(ndim)]
        cands.append(((_R, _R), (_R,)))
        return cands

    decision = choose(call, candidates)
    sharded = tuple(a for a, q in enumerate(decision.inputs[0]) if isinstance(q, Shard))
    if sharded and math.isinf(p):
        decision.local_fn = _local_max_distance
    elif sharded and p != 1:
        decision.local_fn = _sharded_distance(p, (call.mesh, sharded))
        decision.reduces = sharded
    return decision


def _local_max_distance(a: torch.Tensor, b: torch.Tensor, p: Any = None) -> torch.Tensor:
    """max ``|a - b|`` of a shard; an empty shard gives 0, which never beats a real distance."""
    if a.numel() == 0:
        return a.new_zeros(())
    return (a - b).abs().amax()


def _sharded_distance(p: float, over: Over) -> Any:
    norm = _sharded_norm(p, over)

    def distance(a: torch.Tensor, b: torch.Tensor, p: Any = None) -> torch.Tensor:
        return norm(a - b)  # type: ignore[no-any-return]

    return distance


register_rule(aten.dist.default)(_dist_rule)


def _histc_rule(call: OpCall) -> Decision:
    """``histc`` with a given range (``min < max``) counts each shard locally: a Partial sum.

    As torch's: without a range the data's own min and max set the bins, so the input
    is gathered (Replicate).
    """
    args = call.args
    low = args[2] if len(args) > 2 else call.kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else call.kwargs.get("max", 0)
    ranged = low != high
    ins: list[Placement] = []
    outs: list[Placement] = []
    for p in call.specs[0].placements:
        if ranged and isinstance(p, Shard):
            ins.append(p)
            outs.append(Partial())
        else:
            ins.append(_R)
            outs.append(_R)
    return Decision([tuple(ins)], [tuple(outs)])


register_rule(aten.histc.default)(_histc_rule)

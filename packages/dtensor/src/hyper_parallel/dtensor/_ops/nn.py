"""Sharding rules of neural-network ops: embedding, layer norm, batch norm, attention, factories."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._registry import Decision, Declined, OpCall, register_rule
from hyper_parallel.dtensor._spec import DTensorSpec, local_shape_and_offset
from hyper_parallel.dtensor.collectives import all_reduce_over
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_R = Replicate()
_P = Partial()


# -- embedding ---------------------------------------------------------------------------


def _embedding_rule(call: OpCall) -> Decision:
    weight, indices = call.specs[0], call.specs[1]
    idx_nd = indices.ndim

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = [((_R, Shard(d)), (Shard(d),)) for d in range(idx_nd)]
        cands.append(((Shard(1), _R), (Shard(idx_nd),)))
        cands.append(((Shard(0), _R), (_P,)))
        cands.append(((_R, _R), (_R,)))
        return cands

    decision = choose(call, candidates)
    w_target = decision.inputs[0]
    if any(isinstance(p, Shard) and p.dim == 0 for p in w_target):
        mesh = call.mesh
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        shape, offset = local_shape_and_offset(weight.shape, mesh.shape, coordinate, w_target)
        decision.local_fn = _masked_embedding(offset[0], shape[0])
    return decision


def _masked_embedding(start: int, length: int) -> Any:
    """Look up only the rows this rank holds; others give zeros (summed across ranks later)."""

    def lookup(
        weight: torch.Tensor, indices: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        shifted = indices - start
        outside = (shifted < 0) | (shifted >= length)
        rows = torch.nn.functional.embedding(shifted.masked_fill(outside, 0), weight)
        return rows.masked_fill(outside.unsqueeze(-1), 0)

    return lookup


def _embedding_backward_rule(call: OpCall) -> Decision:
    grad, indices = call.specs[0], call.specs[1]
    idx_nd = indices.ndim

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = [((Shard(d), Shard(d)), (_P,)) for d in range(idx_nd)]
        cands.append(((Shard(idx_nd), _R), (Shard(1),)))
        cands.append(((_R, _R), (_R,)))
        cands.append(((_P, _R), (_P,)))
        return cands

    del grad
    return choose(call, candidates)


# -- layer norm --------------------------------------------------------------------------


def _layer_norm_rule(call: OpCall) -> Decision:
    x = call.specs[0]
    normalized = call.args[1]
    batch_dims = x.ndim - len(normalized)
    n_in = len(call.specs)
    n_out = len(call.out_metas)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for d in range(batch_dims):
            cands.append(((Shard(d),) + (_R,) * (n_in - 1), (Shard(d),) * n_out))
        cands.append(((_R,) * n_in, (_R,) * n_out))
        return cands

    return choose(call, candidates)


def _layer_norm_backward_rule(call: OpCall) -> Decision:
    # specs: grad_out, input, mean, rstd, [weight], [bias]; outputs: grad_input, grad_weight, grad_bias
    x = call.specs[1]
    normalized = call.args[2]
    batch_dims = x.ndim - len(normalized)
    n_in = len(call.specs)

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        for d in range(batch_dims):
            ins = (Shard(d),) * 4 + (_R,) * (n_in - 4)
            cands.append((ins, (Shard(d), _P, _P)))
        cands.append(((_R,) * n_in, (_R, _R, _R)))
        return cands

    return choose(call, candidates)


# -- batch norm --------------------------------------------------------------------------
#
# Batch norm normalises each channel (dim 1) over the batch and spatial dims. A channel
# shard is local (torch's only sharded rule). A shard of the batch or a spatial dim is
# local in eval mode (the running statistics are per channel); in train mode the kernel
# all-reduces the per-channel sums over the axes that split those dims (SyncBatchNorm),
# so the statistics, and the running_mean / running_var updated in place, are the
# one-device ones and the activations never move.


def _arg_positions(call: OpCall) -> dict[str, int]:
    """Schema argument name -> spec index, for the tensor arguments present in the call."""
    names = [a.name for a in call.func._schema.arguments]
    positions: dict[str, int] = {}
    k = 0
    for i, a in enumerate(call.args):
        if isinstance(a, DTensorSpec):
            positions[names[i]] = k
            k += 1
    return positions


def _flag(call: OpCall, name: str, default: bool) -> bool:
    names = [a.name for a in call.func._schema.arguments]
    if name in call.kwargs:
        return bool(call.kwargs[name])
    i = names.index(name) if name in names else len(call.args)
    return bool(call.args[i]) if i < len(call.args) else default


def _batch_norm_candidates(
    call: OpCall, big: Sequence[int], written: Sequence[int], outs: Sequence[str | None]
) -> Any:
    """Per axis: channel shard, batch/spatial shard (per-channel tensors replicated), replicate.

    ``big`` are the specs laid out like the input (N, C, *); ``written`` the running
    statistics updated in place, which must keep their layout (the schema does not
    mark them written, so ``choose`` would not know). ``outs`` is a template of the
    outputs: ``"big"`` entries follow the input, the rest are per channel.
    """
    n_in = len(call.specs)
    ndim = call.specs[big[0]].ndim
    empty = {i for i, s in enumerate(call.specs) if 0 in s.shape and i not in big}

    def per_channel(i: int, channel: Placement) -> Placement:
        return _R if i in empty else channel

    def candidates(axis: int) -> list[Candidate]:
        cands: list[Candidate] = []
        layouts: list[tuple[Placement, Placement]] = [(Shard(1), Shard(0))]
        layouts += [(Shard(d), _R) for d in (0, *range(2, ndim))]
        layouts.append((_R, _R))
        for big_p, channel in layouts:
            ins = tuple(big_p if i in big else per_channel(i, channel) for i in range(n_in))
            if any(ins[i] != call.specs[i].placements[axis] for i in written):
                continue
            out_ps = tuple(big_p if o == "big" else (_R if o is None else channel) for o in outs)
            cands.append((ins, out_ps))
        return cands

    return candidates


def _stat_axes(call: OpCall, decision: Decision, x_index: int) -> tuple[int, ...]:
    """The mesh axes on which the input is split along a dim the statistics reduce over."""
    return tuple(
        axis
        for axis, p in enumerate(decision.inputs[x_index])
        if isinstance(p, Shard) and p.dim != 1 and call.mesh.shape[axis] > 1
    )


def _batch_norm_rule(call: OpCall) -> Decision:
    pos = _arg_positions(call)
    if "input" not in pos or pos["input"] != 0:
        raise Declined(f"{call.func}: the input is not a DTensor")
    written = [pos[n] for n in ("running_mean", "running_var") if n in pos]
    training = _flag(call, "training", False)
    # save_mean / save_invstd are empty in eval mode on CPU: replicated
    outs: list[str | None] = ["big"]
    for meta in call.out_metas[1:3]:
        outs.append(None if meta is None or 0 in meta.shape else "channel")
    decision = choose(call, _batch_norm_candidates(call, [0], written, outs))
    axes = _stat_axes(call, decision, 0)
    if training and axes:
        decision.local_fn = _synced_batch_norm(call.func, (call.mesh, axes))
        decision.reduces = axes
    return decision


def _batch_norm_backward_rule(call: OpCall) -> Decision:
    pos = _arg_positions(call)
    if pos.get("grad_out") != 0 or pos.get("input") != 1:
        raise Declined(f"{call.func}: grad_out or input is not a DTensor")
    training = _flag(call, "train", False)
    outs: list[str | None] = ["big", "channel", "channel"]
    decision = choose(call, _batch_norm_candidates(call, [0, 1], [], outs))
    axes = _stat_axes(call, decision, 1)
    if axes:
        if training:
            decision.local_fn = _synced_batch_norm_backward((call.mesh, axes))
            decision.reduces = axes
        else:
            # eval: the input gradient is pointwise; weight and bias gradients are
            # local sums over this rank's rows, i.e. Partial on those axes
            outputs = decision.outputs
            for j in (1, 2):
                placements = outputs[j]
                if placements is not None:
                    outputs[j] = tuple(_P if a in axes else p for a, p in enumerate(placements))
    return decision


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _reduce_dims(ndim: int) -> list[int]:
    return [0, *range(2, ndim)]


def _synced_batch_norm(func: Any, over: tuple[DeviceMesh, tuple[int, ...]]) -> Any:
    names = [a.name for a in func._schema.arguments]

    def batch_norm(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        x: torch.Tensor = bound["input"]
        weight, bias = bound.get("weight"), bound.get("bias")
        running_mean, running_var = bound.get("running_mean"), bound.get("running_var")
        momentum, eps = float(bound["momentum"]), float(bound["eps"])
        dims = _reduce_dims(x.ndim)
        acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = acc.new_full((1,), float(x.numel() // max(x.shape[1], 1)))
        totals = all_reduce_over(torch.cat([acc.sum(dims), count]), *over, "sum")
        n = totals[-1]
        mean = totals[:-1] / n
        centred = acc - _channel_view(mean, x.ndim)
        var = all_reduce_over(centred.pow(2).sum(dims), *over, "sum") / n
        invstd = torch.rsqrt(var + eps)
        out = centred * _channel_view(invstd, x.ndim)
        if weight is not None:
            out = out * _channel_view(weight, x.ndim)
        if bias is not None:
            out = out + _channel_view(bias, x.ndim)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * (n / (n - 1).clamp(min=1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        return out.to(x.dtype), mean, invstd

    return batch_norm


def _synced_batch_norm_backward(over: tuple[DeviceMesh, tuple[int, ...]]) -> Any:
    def backward(
        grad_out: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        save_mean: torch.Tensor,
        save_invstd: torch.Tensor,
        train: bool,
        eps: float,
        output_mask: Sequence[bool],
    ) -> tuple[torch.Tensor | None, ...]:
        del running_mean, running_var, train, eps
        dims = _reduce_dims(x.ndim)
        invstd = _channel_view(save_invstd, x.ndim)
        xhat = (x - _channel_view(save_mean, x.ndim)) * invstd
        count = grad_out.new_full((1,), float(x.numel() // max(x.shape[1], 1)))
        local = torch.cat([grad_out.sum(dims), (grad_out * xhat).sum(dims), count])
        totals = all_reduce_over(local, *over, "sum")
        c = save_mean.shape[0]
        sum_dy, sum_dy_xhat, n = totals[:c], totals[c : 2 * c], totals[-1]
        grad_input = None
        if output_mask[0]:
            scale = invstd if weight is None else invstd * _channel_view(weight, x.ndim)
            grad_input = (
                grad_out
                - _channel_view(sum_dy / n, x.ndim)
                - xhat * _channel_view(sum_dy_xhat / n, x.ndim)
            ) * scale
        grad_weight = sum_dy_xhat if output_mask[1] else None
        grad_bias = sum_dy if output_mask[2] else None
        return grad_input, grad_weight, grad_bias

    return backward


# -- attention ---------------------------------------------------------------------------


def _attention_rule(call: OpCall) -> Decision:
    """Fused attention kernels: batch (dim 0) or heads (dim 1) may be sharded, never the sequence.

    Every 4-D tensor (query, key, value, output, their gradients, a mask) and every
    3-D one (log-sum-exp) shares the batch and head dims; a size-1 dim of a mask
    broadcasts and stays replicated. Grouped-query attention keeps its grouping
    under head sharding when both head counts split evenly over the mesh axis.
    """
    ref = next(s for s in call.specs if s.ndim == 4)
    mesh = call.mesh

    def layout(shape: tuple[int, ...], d: int) -> Placement:
        if len(shape) >= 3 and (shape[d] != 1 or ref.shape[d] == 1):
            return Shard(d)
        return _R

    def candidates(axis: int) -> list[Candidate]:
        n = mesh.shape[axis]
        cands: list[Candidate] = []
        for d in (0, 1):
            sizes = {s.shape[d] for s in call.specs if s.ndim == 4 and s.shape[d] != 1}
            if d == 1 and any(size % n for size in sizes):
                continue  # grouped heads stay aligned only when every head count splits evenly
            ins = tuple(layout(s.shape, d) for s in call.specs)
            outs = tuple(None if m is None else layout(m.shape, d) for m in call.out_metas)
            cands.append((ins, outs))
        cands.append(
            ((_R,) * len(call.specs), tuple(None if m is None else _R for m in call.out_metas))
        )
        return cands

    return choose(call, candidates)


# -- factories shaped like an input ------------------------------------------------------------


def _like_rule(call: OpCall) -> Decision:
    """empty_like / zeros_like / ones_like / full_like / rand-free *_like: the input's layout.

    The input's values are never read, so it does not move: a Partial input (the seed
    gradient of ``loss.backward()`` on a Partial loss) gives a Replicate output of ones
    without any collective, as in torch.
    """
    spec = call.specs[0]
    keeps_partial = call.func.overloadpacket is aten.empty_like  # torch: zeros_like replicates
    placements = tuple(
        p if not isinstance(p, Partial) or keeps_partial else _R for p in spec.placements
    )
    return Decision([spec.placements], [placements])


def _new_factory_rule(call: OpCall) -> Decision:
    """new_empty / new_zeros / ...: the input's layout when the size is the input's, else Replicate."""
    spec = call.specs[0]
    size = tuple(call.args[1])
    out_meta = call.out_metas[0]
    assert out_meta is not None
    keeps = call.func.overloadpacket in (aten.new_empty, aten.new_empty_strided)  # as torch
    placements: tuple[Placement, ...]
    if size == spec.shape:
        placements = tuple(
            _R if isinstance(p, Partial) and not keeps else p for p in spec.placements
        )
    else:
        placements = (_R,) * call.mesh.ndim
    decision = Decision([spec.placements], [placements])
    if any(isinstance(p, Shard) for p in placements):
        decision.rewrite = _local_size_rewrite
    return decision


def _eye_out_rule(call: OpCall) -> Decision:
    """``torch.eye(n, m, out=dt)`` (``nn.init.eye_``): each rank writes its block of the identity.

    The written tensor keeps its layout; a Partial target is declined (the fallback).
    """
    spec = call.specs[0]
    if spec.has_partial():
        raise Declined(f"{call.func}: the identity cannot be written into a Partial")
    decision = Decision([spec.placements], [spec.placements])
    if any(isinstance(p, Shard) for p in spec.placements):
        mesh = call.mesh
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        shape, offset = local_shape_and_offset(spec.shape, mesh.shape, coordinate, spec.placements)
        decision.local_fn = _eye_block(shape, offset)
    return decision


def _eye_block(shape: Sequence[int], offset: Sequence[int]) -> Any:
    """Write the block at ``offset`` of the identity into ``out`` (the local shard)."""

    def eye(*args: Any, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        first = max(offset[0], offset[1])
        last = min(offset[0] + shape[0], offset[1] + shape[1])
        if last > first:
            idx = torch.arange(first, last, device=out.device)
            out[idx - offset[0], idx - offset[1]] = 1
        return out

    return eye


def _local_size_rewrite(
    args: Sequence[Any], kwargs: dict[str, Any], out_shapes: list[tuple[int, ...] | None]
) -> tuple[Sequence[Any], dict[str, Any]]:
    shape = list(out_shapes[0] or ())
    rest = args[2:]
    if len(args) > 2 and isinstance(args[2], (list, tuple)):  # new_empty_strided's stride
        strides: list[int] = []
        acc = 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        rest = (list(reversed(strides)), *args[3:])
    return (args[0], shape, *rest), kwargs


register_rule(aten.embedding.default)(_embedding_rule)
register_rule(aten.embedding_dense_backward.default)(_embedding_backward_rule)
register_rule(aten.native_layer_norm.default)(_layer_norm_rule)
register_rule(aten.native_layer_norm_backward.default)(_layer_norm_backward_rule)
register_rule(
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
)(_batch_norm_rule)
register_rule(aten.native_batch_norm_backward.default)(_batch_norm_backward_rule)
register_rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)(_attention_rule)
register_rule(
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default
)(_like_rule)
register_rule(aten.eye.m_out, aten.eye.out)(_eye_out_rule)
register_rule(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)(_new_factory_rule)

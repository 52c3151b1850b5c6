"""Sharding rules of neural-network ops: embedding, layer norm, attention, factories."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel.dtensor._ops._strategy import Candidate, choose
from hyper_parallel.dtensor._registry import Decision, OpCall, register_rule
from hyper_parallel.dtensor._spec import local_shape_and_offset
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
register_rule(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)(_new_factory_rule)

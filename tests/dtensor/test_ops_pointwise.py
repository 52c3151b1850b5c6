"""Element-wise ops on DTensors equal the ops on full tensors, forward and backward.

Unary and binary ops with broadcasting, Python scalars and 0-dim tensors, in-place
forms, and Partial inputs where the op is linear, over random shapes (uneven shards
included) and every shard dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests._harness import world_sizes
from tests.dtensor._op_oracle import OpCase, rand_shape, run_cases, shard_layouts

from hyper_parallel.dtensor import Partial, Replicate, Shard

_R = Replicate()
_P = Partial()


def _unary_cases(gen: torch.Generator) -> list[OpCase]:
    x = torch.randn(rand_shape(gen, 3), generator=gen)
    positive = x.abs() + 0.5
    one_d = [(p,) for p in shard_layouts(3)]
    linear = [(p,) for p in shard_layouts(3, partial=True)]
    return [
        OpCase("neg", torch.neg, (x,), linear),
        OpCase("mul_scalar", lambda t: t * 2.5, (x,), linear),
        OpCase("div_scalar", lambda t: t / 4.0, (x,), linear),
        OpCase("to_double", lambda t: t.to(torch.float64), (x,), linear),
        OpCase("clone", torch.clone, (x,), linear),
        OpCase("exp", torch.exp, (x,), one_d),
        OpCase("silu", F.silu, (x,), one_d),
        OpCase("gelu", F.gelu, (x,), one_d),
        OpCase("relu", torch.relu, (x,), one_d),
        OpCase("tanh", torch.tanh, (x,), one_d),
        OpCase("rsqrt", torch.rsqrt, (positive,), one_d),
        OpCase("pow_scalar", lambda t: t.pow(2), (x,), one_d),
        OpCase("add_scalar", lambda t: t + 1.5, (x,), one_d),
        OpCase("rsub_scalar", lambda t: 1.0 - t, (x,), one_d),
        OpCase("clamp", lambda t: t.clamp(-0.5, 0.5), (x,), one_d),
        OpCase("gt_scalar", lambda t: t > 0.1, (x,), one_d, grad=False),
        OpCase("masked_fill", lambda t: t.masked_fill(t > 0, 0.0), (x,), one_d),
    ]


def _binary_cases(gen: torch.Generator) -> list[OpCase]:
    a, b, c = rand_shape(gen, 3)
    x = torch.randn(a, b, c, generator=gen)
    y = torch.randn(a, b, c, generator=gen)
    row = torch.randn(b, c, generator=gen)
    col = torch.randn(a, 1, c, generator=gen)
    scalar = torch.tensor(1.7)
    same = [
        (Shard(0), Shard(0)),
        (Shard(1), Shard(1)),
        (Shard(2), Shard(2)),
        (Shard(0), Shard(2)),
        (_R, Shard(1)),
        (Shard(2), _R),
        (_R, _R),
    ]
    broadcast = [
        (Shard(0), _R),
        (Shard(1), Shard(0)),
        (Shard(2), Shard(1)),
        (_R, Shard(0)),
        (_R, _R),
    ]
    broadcast_col = [(Shard(0), Shard(0)), (Shard(1), _R), (Shard(2), Shard(2)), (_R, Shard(0))]
    return [
        OpCase("add", torch.add, (x, y), [*same, (_P, _P)]),
        OpCase("add_alpha", lambda s, t: torch.add(s, t, alpha=-2.0), (x, y), [*same, (_P, _P)]),
        OpCase("sub", torch.sub, (x, y), [*same, (_P, _P)]),
        OpCase("mul", torch.mul, (x, y), [*same, (_P, _R), (_R, _P)]),
        OpCase("div", torch.div, (x, y.abs() + 1.0), [*same, (_P, _R)]),
        OpCase("maximum", torch.maximum, (x, y), same),
        OpCase("add_broadcast_row", torch.add, (x, row), broadcast),
        OpCase("mul_broadcast_row", torch.mul, (x, row), [*broadcast, (_P, _R)]),
        OpCase("mul_broadcast_col", torch.mul, (x, col), broadcast_col),
        OpCase("add_partial_plus_replicate", torch.add, (x, y), [(_P, _R), (_R, _P)]),
        OpCase("mul_0dim_tensor", lambda s: s * scalar, (x,), [(Shard(1),), (_P,), (_R,)]),
        OpCase("where_mask", lambda s, t: torch.where(s > 0, s, t), (x, y), same),
        OpCase("lerp", lambda s, t: torch.lerp(s, t, 0.3), (x, y), same),
        OpCase("addcmul", lambda s, t: torch.addcmul(s, s, t, value=0.5), (x, y), same),
    ]


def _inplace_cases(gen: torch.Generator) -> list[OpCase]:
    a, b = rand_shape(gen, 2)
    x = torch.randn(a, b, generator=gen)
    y = torch.randn(a, b, generator=gen)
    row = torch.randn(b, generator=gen)
    layouts = [(Shard(0), Shard(0)), (Shard(1), _R), (_R, Shard(0)), (_R, _R), (_P, _P), (_P, _R)]
    # A Partial target keeps its layout only where the op is linear in it (P + P, P * R);
    # the other Partial cases are in test_torch_semantics_inplace.py (torch raises there).
    add_layouts = [lay for lay in layouts if lay != (_P, _R)]
    mul_layouts = [lay for lay in layouts if lay != (_P, _P)]
    return [
        OpCase("add_", lambda s, t: s.clone().add_(t), (x, y), add_layouts),
        OpCase("mul_", lambda s, t: s.clone().mul_(t), (x, y), mul_layouts),
        OpCase("add_scalar_", lambda s: s.clone().add_(2.0), (x,), [(Shard(0),), (_R,)]),
        OpCase(
            "mul_broadcast_",
            lambda s, t: s.clone().mul_(t),
            (x, row),
            [(Shard(1), Shard(0)), (Shard(0), _R)],
        ),
        OpCase("fill_", lambda s: s.clone().fill_(3.0), (x,), [(Shard(0),), (_R,)]),
        OpCase("zero_", lambda s: s.clone().zero_(), (x,), [(Shard(1),), (_P,)]),
        OpCase("copy_", lambda s, t: s.clone().copy_(t), (x, y), layouts),
        OpCase(
            "copy_broadcast",
            lambda s, t: s.clone().copy_(t),
            (x, row),
            [(Shard(1), Shard(0)), (Shard(0), _R)],
        ),
        OpCase(
            "addcdiv_",
            lambda s, t: s.clone().addcdiv_(t, t.abs() + 1, value=-0.1),
            (x, y),
            layouts[:4],
        ),
    ]


def pointwise_cases() -> list[OpCase]:
    """Every pointwise case (built on each rank from a fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    return _unary_cases(gen) + _binary_cases(gen) + _inplace_cases(gen)


@world_sizes(2, 4)
def test_pointwise_ops_match_full_tensors(world_size: int) -> None:
    run_cases(pointwise_cases, world_size)

"""Reductions and softmax on DTensors equal the ops on full tensors, forward and backward.

sum, mean, amax/amin, max/min (values and indices), var/std, vector norms, over
sharded and unsharded dims, keepdim or not, Partial inputs where the reduction
keeps them; softmax and log_softmax over every dim, the sharded one included
(computed with in-kernel all-reduces, the output stays sharded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests._harness import world_sizes
from tests.dtensor._op_oracle import OpCase, rand_shape, run_cases, shard_layouts

from hyper_parallel.dtensor import Partial, Replicate, Shard

_R = Replicate()


def reduction_cases() -> list[OpCase]:
    """Every reduction case (built on each rank from a fixed seed)."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(rand_shape(gen, 3, 2, 7), generator=gen)
    every = [(p,) for p in shard_layouts(3)]
    with_partial = [(p,) for p in shard_layouts(3, partial=True)]
    cases = [
        OpCase("sum_all", torch.sum, (x,), with_partial),
        OpCase("mean_all", torch.mean, (x,), with_partial),
        OpCase("amax_all", torch.amax, (x,), [*every, (Partial("max"),)]),
        OpCase("max_all", torch.max, (x,), every),
        OpCase("min_all", torch.min, (x,), [*every, (Partial("min"),)]),
        OpCase("norm_all", torch.linalg.vector_norm, (x,), every),
        OpCase("norm_inf", lambda t: torch.linalg.vector_norm(t, float("inf")), (x,), every),
        OpCase("var_all", torch.var, (x,), every),
    ]
    for dim in (0, 1, -1):
        for keepdim in (False, True):
            tag = f"dim{dim}_keep{int(keepdim)}"
            cases += [
                OpCase(
                    f"sum_{tag}",
                    lambda t, d=dim, k=keepdim: t.sum(d, keepdim=k),
                    (x,),
                    with_partial,
                ),
                OpCase(
                    f"mean_{tag}",
                    lambda t, d=dim, k=keepdim: t.mean(d, keepdim=k),
                    (x,),
                    with_partial,
                ),
                OpCase(
                    f"amax_{tag}",
                    lambda t, d=dim, k=keepdim: t.amax(d, keepdim=k),
                    (x,),
                    [*every, (Partial("max"),)],
                ),
                OpCase(
                    f"amin_{tag}", lambda t, d=dim, k=keepdim: t.amin(d, keepdim=k), (x,), every
                ),
                OpCase(
                    f"max_dim_{tag}", lambda t, d=dim, k=keepdim: t.max(d, keepdim=k), (x,), every
                ),
                OpCase(
                    f"min_dim_{tag}", lambda t, d=dim, k=keepdim: t.min(d, keepdim=k), (x,), every
                ),
                OpCase(
                    f"argmax_{tag}",
                    lambda t, d=dim, k=keepdim: t.argmax(d, keepdim=k),
                    (x,),
                    every,
                    grad=False,
                ),
                OpCase(f"var_{tag}", lambda t, d=dim, k=keepdim: t.var(d, keepdim=k), (x,), every),
                OpCase(
                    f"std_unbiased0_{tag}",
                    lambda t, d=dim, k=keepdim: t.std(d, correction=0, keepdim=k),
                    (x,),
                    every,
                ),
                OpCase(
                    f"norm_{tag}",
                    lambda t, d=dim, k=keepdim: torch.linalg.vector_norm(t, 2, d, k),
                    (x,),
                    every,
                ),
            ]
    cases += [
        OpCase("sum_dims_0_2", lambda t: t.sum((0, 2)), (x,), with_partial),
        OpCase("mean_dims_1_2", lambda t: t.mean((1, 2), keepdim=True), (x,), with_partial),
        OpCase("norm_l1_dim1", lambda t: torch.linalg.vector_norm(t, 1, 1), (x,), every),
        OpCase("sum_dtype", lambda t: t.sum(1, dtype=torch.float64), (x,), with_partial),
    ]
    for dim in (0, 1, 2):
        cases += [
            OpCase(f"softmax_{dim}", lambda t, d=dim: F.softmax(t, d), (x,), every),
            OpCase(f"log_softmax_{dim}", lambda t, d=dim: F.log_softmax(t, d), (x,), every),
        ]
    # a class dim that splits into an empty shard on 4 ranks
    narrow = torch.randn(3, 3, generator=gen)
    cases += [
        OpCase(
            "log_softmax_narrow",
            lambda t: F.log_softmax(t, -1),
            (narrow,),
            [(Shard(1),), (Shard(0),)],
        ),
        OpCase("softmax_narrow", lambda t: F.softmax(t, -1), (narrow,), [(Shard(1),)]),
        OpCase("any_dim", lambda t: (t > 0).any(1), (x,), every, grad=False),
        OpCase("all_dim", lambda t: (t > -1).all(0), (x,), every, grad=False),
    ]
    return cases


@world_sizes(2, 4)
def test_reductions_match_full_tensors(world_size: int) -> None:
    run_cases(reduction_cases, world_size)

"""Matrix products on DTensors equal the products of full tensors, forward and backward.

mm, bmm, addmm, baddbmm, F.linear (with and without bias, 2-D and 3-D input),
matmul with broadcasting batch dims, and einsum: rows, columns and the contracted
dim sharded, Partial operands, uneven sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests._harness import world_sizes
from tests.dtensor._op_oracle import OpCase, rand_shape, run_cases

from hyper_parallel.dtensor import Partial, Replicate, Shard

_R = Replicate()
_P = Partial()

# (a, b) layouts of a @ b: rows of a, columns of b, the contracted dim, Partial operands.
_MM_LAYOUTS = [
    (Shard(0), _R),
    (_R, Shard(1)),
    (Shard(1), Shard(0)),
    (_R, _R),
    (Shard(0), Shard(0)),
    (Shard(1), _R),
    (_P, _R),
    (_R, _P),
]


def matrix_cases() -> list[OpCase]:
    """Every matrix-product case (built on each rank from a fixed seed)."""
    gen = torch.Generator().manual_seed(11)
    m, k, n = rand_shape(gen, 3, 2, 8)
    b = int(torch.randint(2, 5, (1,), generator=gen))
    a2 = torch.randn(m, k, generator=gen)
    b2 = torch.randn(k, n, generator=gen)
    bias = torch.randn(n, generator=gen)
    a3 = torch.randn(b, m, k, generator=gen)
    b3 = torch.randn(b, k, n, generator=gen)
    x3 = torch.randn(b, m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    vec = torch.randn(k, generator=gen)
    bmm_layouts = [
        (Shard(0), Shard(0)),
        (Shard(1), _R),
        (_R, Shard(2)),
        (Shard(2), Shard(1)),
        (_R, _R),
        (_P, _R),
    ]
    return [
        OpCase("mm", torch.mm, (a2, b2), _MM_LAYOUTS),
        OpCase(
            "addmm",
            lambda c, s, t: torch.addmm(c, s, t, beta=0.5, alpha=2.0),
            (bias, a2, b2),
            [(_R, *lay) for lay in _MM_LAYOUTS]
            + [(Shard(0), _R, Shard(1)), (_P, Shard(1), Shard(0))],
        ),
        OpCase("bmm", torch.bmm, (a3, b3), bmm_layouts),
        OpCase(
            "baddbmm",
            lambda c, s, t: torch.baddbmm(c, s, t, alpha=0.5),
            (torch.randn(b, m, n, generator=gen), a3, b3),
            [(Shard(0), *lay) for lay in bmm_layouts[:3]] + [(_R, Shard(2), Shard(1))],
        ),
        OpCase(
            "linear_column_parallel",
            F.linear,
            (x3, w, bias),
            [(_R, Shard(0), Shard(0)), (Shard(0), _R, _R), (Shard(1), Shard(0), Shard(0))],
        ),
        OpCase(
            "linear_row_parallel",
            F.linear,
            (x3, w, bias),
            [(Shard(2), Shard(1), _R), (Shard(2), Shard(1), Shard(0)), (_R, _R, _R)],
        ),
        OpCase(
            "linear_no_bias",
            F.linear,
            (a2, w),
            [(_R, Shard(0)), (Shard(1), Shard(1)), (Shard(0), _R), (_P, _R)],
        ),
        OpCase(
            "matmul_batched_broadcast",
            torch.matmul,
            (a3, b2),
            [(Shard(0), _R), (Shard(2), Shard(0)), (_R, Shard(1)), (Shard(1), _R)],
        ),
        OpCase(
            "matmul_vector",
            torch.matmul,
            (a2, vec),
            [(Shard(0), _R), (Shard(1), Shard(0)), (_R, _R)],
        ),
        OpCase(
            "einsum_bij_bjk",
            lambda s, t: torch.einsum("bij,bjk->bik", s, t),
            (a3, b3),
            [(Shard(0), Shard(0)), (Shard(2), Shard(1)), (_R, Shard(2))],
        ),
    ]


@world_sizes(2, 4)
def test_matrix_ops_match_full_tensors(world_size: int) -> None:
    run_cases(matrix_cases, world_size)

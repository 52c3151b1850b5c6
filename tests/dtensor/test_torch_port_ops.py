"""Cases of torch's own op tests, run on hp-dtensor and on torch.distributed.tensor.

Ported (in our words) from torch's ``test_math_ops.py``, ``test_pointwise_ops.py``,
``test_view_ops.py``, ``test_tensor_ops.py``, ``test_matrix_ops.py`` and
``test_embedding_ops.py`` at the behaviours a user sees: each case runs on both
implementations over a 1-D mesh of 4 ranks with the same inputs, in one launch.
Output placements and forward collectives must equal torch's (each side's
``CommDebugMode``), values and gradients the same computation on full tensors in one
process. ``DIFFERENT`` lists the README's deliberate differences with what hp-dtensor
gives there; ``TORCH_LACKS`` the cases where torch raises or takes another route and
only hp's values are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import Case, Expected, assert_like_torch, run_cases_on_both

_G = torch.Generator().manual_seed(41)
_A = torch.randn(8, 4, 6, generator=_G)
_M = torch.randn(8, 6, generator=_G)
_N = torch.randn(6, 8, generator=_G)
_V = torch.randn(8, generator=_G)
_BA = torch.randn(4, 8, 6, generator=_G)
_BB = torch.randn(4, 6, 4, generator=_G)
_POS = torch.rand(8, 6, generator=_G) + 0.1
_IDX = torch.tensor([[0, 3, 5], [1, 1, 2], [5, 4, 0], [2, 4, 4]])
_EMB = torch.randn(10, 8, generator=_G)
_MASK = torch.rand(8, 6, generator=_G) > 0.5
_U1 = torch.randn(1, 2, 2, 2, generator=_G)
_U5 = torch.randn(5, 2, 2, 2, generator=_G)


def _math() -> list[Case]:
    """``test_math_ops.py``: reductions, softmax, layer norm, nll, topk, cumsum, var."""
    cases: list[Case] = []
    for name in ("sum", "prod", "amax", "amin", "mean"):
        for dim in (0, 1):
            cases.append(
                Case(
                    f"math {name}(dim={dim}) of S0",
                    lambda t, n=name, d=dim: getattr(t, n)(d),
                    (_A,),
                    ("S0",),
                )
            )
        cases.append(
            Case(f"math {name}() of S0", lambda t, n=name: getattr(t, n)(), (_A,), ("S0",))
        )
    cases += [
        Case("math max(dim=1) of S0", lambda t: t.max(1)[0], (_A,), ("S0",)),
        Case("math min(dim=0, keepdim) of S1", lambda t: t.min(0, True)[0], (_A,), ("S1",)),
        Case("math all() of a bool S0", lambda t: (t > 0).all(), (_A,), ("S0",)),
        Case("math any() of a bool S1", lambda t: (t > 1).any(), (_A,), ("S1",)),
        Case("math any(dim=2) of a bool S0", lambda t: (t > 0).any(2), (_A,), ("S0",)),
        Case("math softmax(-1) of S0", lambda t: F.softmax(t, -1), (_A,), ("S0",), backward=True),
        Case("math softmax(0) of S1", lambda t: F.softmax(t, 0), (_A,), ("S1",), backward=True),
        Case("math log_softmax(1) of S2", lambda t: F.log_softmax(t, 1), (_A,), ("S2",)),
        Case(
            "math layer_norm(last) of S1",
            lambda t: F.layer_norm(t, (6,)),
            (_A,),
            ("S1",),
            backward=True,
        ),
        Case("math layer_norm(last 2) of S0", lambda t: F.layer_norm(t, (4, 6)), (_A,), ("S0",)),
        Case("math var(dim=1) of S0", lambda t: t.var(1), (_A,), ("S0",)),
        Case("math std(dim=0) of S1", lambda t: t.std(0), (_A,), ("S1",)),
        Case("math cumsum(dim=1) of S0", lambda t: t.cumsum(1), (_A,), ("S0",), backward=True),
        Case("math topk(2, dim=-1) of S0", lambda t: t.topk(2, -1)[0], (_A,), ("S0",)),
        Case("math logsumexp(dim=2) of S0", lambda t: t.logsumexp(2), (_A,), ("S0",)),
        Case("math vector_norm of S0", lambda t: torch.linalg.vector_norm(t), (_A,), ("S0",)),
        Case(
            "math linalg.norm(dim=1) of S0", lambda t: torch.linalg.norm(t, dim=1), (_M,), ("S0",)
        ),
        Case(
            "math nll_loss(mean) of batch shards",
            lambda x, y: F.nll_loss(F.log_softmax(x, -1), y),
            (_M, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])),
            ("S0", "S0"),
            backward=True,
        ),
        Case(
            "math nll_loss(none) of batch shards",
            lambda x, y: F.nll_loss(x, y, reduction="none"),
            (_M, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])),
            ("S0", "S0"),
        ),
        Case(
            "math cross_entropy(sum) of batch shards",
            lambda x, y: F.cross_entropy(x, y, reduction="sum"),
            (_M, torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])),
            ("S0", "R"),
        ),
    ]
    return cases


def _pointwise() -> list[Case]:
    """``test_pointwise_ops.py``: activations, binary ops, partial rules, where, type promotion."""
    activations: dict[str, Callable[..., Any]] = {
        "relu": F.relu,
        "gelu": F.gelu,
        "silu": F.silu,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
    }
    cases = [
        Case(f"pointwise {name} of S0", fn, (_M,), ("S0",), backward=True)
        for name, fn in activations.items()
    ]
    cases += [
        Case("pointwise add of S0 and S0", torch.add, (_M, _M * 2), ("S0", "S0")),
        Case("pointwise mul of S1 and R", torch.mul, (_M, _M * 2), ("S1", "R"), backward=True),
        Case("pointwise sub of broadcast row R from S0", torch.sub, (_M, _M[0]), ("S0", "R")),
        Case("pointwise div of S0 by a scalar", lambda t: t / 3.0, (_M,), ("S0",)),
        Case("pointwise neg of a partial", torch.neg, (_M,), ("P",)),
        Case("pointwise mul of a partial by a scalar", lambda t: t * 4, (_M,), ("P",)),
        Case("pointwise add of partials", torch.add, (_M, _M), ("P", "P")),
        Case("pointwise relu of a partial", F.relu, (_M,), ("P",)),
        Case("pointwise abs of S0", torch.abs, (_M,), ("S0",)),
        Case(
            "pointwise where(mask) of S0",
            lambda m, a, b: torch.where(m, a, b),
            (_MASK, _M, _M * 0),
            ("S0", "S0", "S0"),
        ),
        Case(
            "pointwise int + float promotes",
            lambda a, b: a + b,
            (torch.arange(48).reshape(8, 6), _M),
            ("S0", "S0"),
        ),
        Case("pointwise pow of S0", lambda t: t.pow(2), (_M,), ("S0",), backward=True),
        Case("pointwise clamp of S1", lambda t: t.clamp(-0.5, 0.5), (_M,), ("S1",)),
        Case(
            "pointwise addcmul of S0",
            lambda a, b, c: torch.addcmul(a, b, c, value=0.5),
            (_M, _M, _POS),
            ("S0", "S0", "S0"),
        ),
        Case("pointwise lerp of S0", lambda a, b: torch.lerp(a, b, 0.3), (_M, _POS), ("S0", "S0")),
        Case("pointwise sqrt of R", torch.sqrt, (_POS,), ("R",)),
    ]
    return cases


def _views() -> list[Case]:
    """``test_view_ops.py``: view, reshape, flatten, permute, transpose, squeeze, expand, chunk."""
    return [
        Case("view (8,4,6)->(8,24) of S0", lambda t: t.view(8, 24), (_A,), ("S0",), backward=True),
        Case("view (8,4,6)->(32,6) of S0", lambda t: t.reshape(32, 6), (_A,), ("S0",)),
        Case("view (8,4,6)->(8,4,2,3) of S1", lambda t: t.view(8, 4, 2, 3), (_A,), ("S1",)),
        Case("view flatten of S2", lambda t: t.flatten(), (_A,), ("S2",)),
        Case("view flatten(1) of S0", lambda t: t.flatten(1), (_A,), ("S0",)),
        Case(
            "view permute(2,0,1) of S0", lambda t: t.permute(2, 0, 1), (_A,), ("S0",), backward=True
        ),
        Case("view transpose(0,1) of S1", lambda t: t.transpose(0, 1), (_A,), ("S1",)),
        Case("view t() of S0", lambda t: t.t(), (_M,), ("S0",)),
        Case("view unsqueeze(0) of S0", lambda t: t.unsqueeze(0), (_M,), ("S0",)),
        Case("view squeeze(1) of S0", lambda t: t.unsqueeze(1).squeeze(1), (_M,), ("S0",)),
        Case("view expand of S1", lambda t: t.unsqueeze(0).expand(3, 8, 6), (_M,), ("S1",)),
        Case("view movedim of S0", lambda t: t.movedim(0, -1), (_A,), ("S0",)),
        Case("view unflatten of S0", lambda t: t.unflatten(2, (2, 3)), (_A,), ("S0",)),
        Case("view narrow on a replicated dim", lambda t: t.narrow(1, 1, 3), (_M,), ("S0",)),
        Case("view slice on a replicated dim", lambda t: t[:, 2:5], (_M,), ("S0",)),
        Case("view chunk on a replicated dim", lambda t: torch.chunk(t, 2, 1)[1], (_M,), ("S0",)),
        Case(
            "view split on a replicated dim", lambda t: torch.split(t, [2, 4], 1)[0], (_M,), ("S0",)
        ),
        Case("view of a partial", lambda t: t.view(48), (_M,), ("P",)),
        # test_dtensor_view_op_uneven: a size-1 sharded dim (only the first rank holds
        # it) and 5 rows over 4 ranks (full, smaller and empty shards) stay sharded
        Case("view uneven (1,2,2,2) of S0", lambda t: t.view(1, 2, 4), (_U1,), ("S0",), True),
        Case("view uneven (5,2,2,2) of S0", lambda t: t.view(5, 2, 4), (_U5,), ("S0",), True),
        Case("view uneven (1,2,2,2)->(1,8) of S0", lambda t: t.view(1, 8), (_U1,), ("S0",)),
    ]


def _tensor_ops() -> list[Case]:
    """``test_tensor_ops.py``: clone, contiguous, like-factories, cat/stack, gather, index, scatter."""
    return [
        Case("tensor clone of S0", torch.clone, (_M,), ("S0",), backward=True),
        Case("tensor contiguous of a transposed S0", lambda t: t.t().contiguous(), (_M,), ("S0",)),
        Case("tensor zeros_like of S0", torch.zeros_like, (_M,), ("S0",)),
        Case("tensor ones_like of a partial", torch.ones_like, (_M,), ("P",)),
        Case("tensor full_like of S1", lambda t: torch.full_like(t, 7.0), (_M,), ("S1",)),
        Case("tensor new_full of S0", lambda t: t.new_full((8, 6), 2.0), (_M,), ("S0",)),
        Case("tensor new_zeros of another size", lambda t: t.new_zeros((3, 2)), (_M,), ("S0",)),
        Case(
            "tensor cat on a replicated dim",
            lambda a, b: torch.cat([a, b], 1),
            (_M, _M),
            ("S0", "S0"),
        ),
        Case("tensor stack of S0", lambda a, b: torch.stack([a, b]), (_M, _POS), ("S0", "S0")),
        Case(
            "tensor gather along a replicated dim",
            lambda t, i: torch.gather(t, 1, i),
            (_M[:4], _IDX),
            ("S0", "S0"),
        ),
        Case(
            "tensor index_select of a replicated dim",
            lambda t, i: t.index_select(1, i),
            (_M, torch.tensor([0, 5, 2])),
            ("S0", "R"),
        ),
        Case(
            "tensor scatter into a replicated dim",
            lambda t, i, s: t.scatter(1, i, s),
            (_M[:4], _IDX, _M[:4, :3]),
            ("S0", "S0", "S0"),
        ),
        Case(
            "tensor masked_fill of S0",
            lambda t, m: t.masked_fill(m, 0.0),
            (_M, _MASK),
            ("S0", "S0"),
        ),
        Case("tensor to(float64) of S0", lambda t: t.to(torch.float64), (_M,), ("S0",)),
        Case("tensor tril of S0", torch.tril, (_M,), ("S0",)),
        Case("tensor roll on a replicated dim", lambda t: torch.roll(t, 2, 1), (_M,), ("S0",)),
        Case("tensor flip on a replicated dim", lambda t: torch.flip(t, [1]), (_M,), ("S0",)),
        Case("tensor repeat of S0", lambda t: t.repeat(1, 2), (_M,), ("S0",)),
        Case("tensor equal of S0", torch.equal, (_M, _M.clone()), ("S0", "S0")),
    ]


def _matrix() -> list[Case]:
    """``test_matrix_ops.py``: mm, addmm, bmm, baddbmm, matmul, einsum, t of a partial."""
    return [
        Case("matrix mm of S0 by R", torch.mm, (_M, _N), ("S0", "R"), backward=True),
        Case("matrix mm of R by S1", torch.mm, (_M, _N), ("R", "S1"), backward=True),
        Case("matrix mm of S1 by S0 (partial)", torch.mm, (_M, _N), ("S1", "S0"), backward=True),
        Case(
            "matrix addmm of S0",
            lambda b, x, w: torch.addmm(b, x, w),
            (_N[0], _M, _N),
            ("R", "S0", "R"),
        ),
        Case("matrix bmm batch shards", torch.bmm, (_BA, _BB), ("S0", "S0"), backward=True),
        Case(
            "matrix baddbmm",
            lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5),
            (torch.randn(4, 8, 4, generator=_G), _BA, _BB),
            ("S0", "S0", "S0"),
        ),
        Case("matrix matmul of 3-d by 2-d", torch.matmul, (_BA, _N), ("S1", "R"), backward=True),
        Case(
            "matrix einsum bij,bjk->bik",
            lambda a, b: torch.einsum("bij,bjk->bik", a, b),
            (_BA, _BB),
            ("S0", "S0"),
        ),
        Case("matrix mv of S0", torch.mv, (_M, _V[:6]), ("S0", "R")),
        Case("matrix t of a partial", lambda t: t.t(), (_M,), ("P",)),
        Case("matrix dot of shards", torch.dot, (_V, _V * 2), ("S0", "S0")),
        Case(
            "matrix linear of S0 input",
            lambda x, w, b: F.linear(x, w, b),
            (_M, _N.t(), _V),
            ("S0", "R", "R"),
            backward=True,
        ),
    ]


def _embedding() -> list[Case]:
    """``test_embedding_ops.py``: colwise and rowwise sharded tables."""
    ids = torch.tensor([[0, 3, 9], [5, 5, 1]])
    return [
        Case(
            "embedding colwise table",
            lambda w, i: F.embedding(i, w),
            (_EMB, ids),
            ("S1", "R"),
            backward=True,
        ),
        Case(
            "embedding rowwise table",
            lambda w, i: F.embedding(i, w),
            (_EMB[:8], ids % 8),
            ("S0", "R"),
        ),
        Case(
            "embedding sharded ids",
            lambda w, i: F.embedding(i, w),
            (_EMB, ids),
            ("R", "S1"),
            backward=True,
        ),
    ]


CASES = _math() + _pointwise() + _views() + _tensor_ops() + _matrix() + _embedding()

# README, "Differences from torch": hp's layout and forward collectives there
DIFFERENT: dict[str, Expected] = {
    # a Partial input of an op that needs its value: reduce-scattered (fewer bytes)
    "pointwise relu of a partial": ((("S", 0),), {"reduce_scatter": 1}),
    # vector norms come out Replicate (one all-reduce), not a lazy norm-Partial
    "math vector_norm of S0": ((("R",),), {"all_reduce": 1}),
    # mean cross-entropy over batch shards: Partial(sum), one all-reduce of the weight total
    "math nll_loss(mean) of batch shards": ((("P", "sum"),), {"all_reduce": 1}),
    # a mean over a sharded dim is a local sum over the global count: Partial(sum)
    "math mean() of S0": ((("P", "sum"),), {}),
    "math mean(dim=0) of S0": ((("P", "sum"),), {}),
    # all()/any() of a sharded bool: the local results form a Partial("min"/"max"), torch gathers
    "math all() of a bool S0": ((("P", "min"),), {}),
    "math any() of a bool S1": ((("P", "max"),), {}),
    # an embedding lookup of sharded ids stays sharded like the ids, torch gathers them
    "embedding sharded ids": ((("S", 1),), {}),
}
TORCH_LACKS: frozenset[str] = frozenset()


def _both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.set_num_threads(1)
    return run_cases_on_both(CASES, world_size)


def test_torch_op_cases_like_torch() -> None:
    for ours, theirs in run_on_ranks(_both, 4, 4, timeout_s=300.0):
        assert_like_torch(ours, theirs, DIFFERENT, TORCH_LACKS)

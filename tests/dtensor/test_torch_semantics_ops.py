"""Ops torch has sharding rules for run through rules here too (no gather fallback).

Ported from torch's ``test_dtensor_ops.py`` / ``test_math_ops.py`` / ``test_tensor_ops.py``
cases: ``cumsum``, ``logsumexp``, ``repeat``, ``topk``, ``prod``, ``constant_pad_nd``,
``nll_loss2d`` (3-D and 4-D input), ``index_put`` with a plain index, ``is_same_size``,
``equal``, ``as_strided`` as a view, ``linear``/``matmul`` under ``inference_mode``
without gathering the weight, and a one-element plain tensor combined with DTensors
(torch's implicit replication). Each case runs on hp-dtensor and on
torch.distributed.tensor with the same inputs: output placements and forward
collectives equal torch's (deliberate differences named here and in the README),
values equal the computation on full tensors, and nothing falls back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._torch_twin import Case, Expected, assert_like_torch, run_cases_on_both

_G = torch.Generator().manual_seed(11)
_X = torch.randn(4, 6, generator=_G)
_W = torch.randn(8, 6, generator=_G)
_X3 = torch.randn(2, 4, 6, generator=_G)
_LOGP4 = torch.randn(4, 3, 2, 2, generator=_G).log_softmax(1)
_T4 = torch.randint(0, 3, (4, 2, 2), generator=_G)
_LOGP3 = torch.randn(4, 3, 5, generator=_G).log_softmax(1)
_T3 = torch.randint(0, 3, (4, 5), generator=_G)


def _inference(fn: Any) -> Any:
    def run(*args: Any) -> Any:
        with torch.inference_mode():
            return fn(*args)

    return run


CASES = [
    Case("cumsum along an unsharded dim", lambda s: torch.cumsum(s, 1), (_X,), ("S0",), True),
    Case("cumsum along the sharded dim", lambda s: torch.cumsum(s, 1), (_X,), ("S1",)),
    Case(
        "logsumexp keeps the other dim's shard",
        lambda s: torch.logsumexp(s, 1),
        (_X,),
        ("S0",),
        True,
    ),
    Case("logsumexp over the sharded dim", lambda s: torch.logsumexp(s, 1), (_X,), ("S1",)),
    Case(
        "repeat keeps a shard of an unrepeated dim", lambda s: s.repeat(1, 2), (_X,), ("S0",), True
    ),
    Case("repeat with new leading dims", lambda s: s.repeat(2, 1, 1), (_X,), ("S0",)),
    Case("topk along an unsharded dim", lambda s: torch.topk(s, 2, dim=1), (_X,), ("S0",), True),
    Case("prod along an unsharded dim", lambda s: torch.prod(s, 1), (_X,), ("S0",)),
    Case("prod of all elements", torch.prod, (_X,), ("S1",)),
    Case("prod over the sharded dim", lambda s: torch.prod(s, 1), (_X,), ("S1",)),
    Case("a product Partial scaled", lambda s: torch.prod(s, 1) * 2.0, (_X,), ("S1",)),
    Case("constant_pad_nd of an unsharded dim", lambda s: F.pad(s, (1, 2)), (_X,), ("S0",), True),
    Case("constant_pad_nd of the sharded dim", lambda s: F.pad(s, (0, 0, 1, 0)), (_X,), ("S0",)),
    Case("nll_loss2d of batch shards", F.nll_loss, (_LOGP4, _T4), ("S0", "S0"), True),
    Case(
        "nll_loss2d summed",
        lambda x, t: F.nll_loss(x, t, reduction="sum"),
        (_LOGP4, _T4),
        ("S0", "S0"),
    ),
    Case("nll_loss of a 3-D input", F.nll_loss, (_LOGP3, _T3), ("S0", "S0"), True),
    Case("is_same_size", lambda a, b: a.is_same_size(b), (_X, _X), ("S0", "S1")),
    Case("equal", torch.equal, (_X, _X), ("S0", "R")),
    Case("not equal", lambda a, b: torch.equal(a, b * 2), (_X, _X), ("S0", "S0")),
    Case(
        "as_strided as the identity view",
        lambda s: s.as_strided((4, 6), (6, 1)) * 2,
        (_X,),
        ("S0",),
    ),
    Case("linear under inference_mode", _inference(F.linear), (_X3, _W), ("R", "S0")),
    Case(
        "linear rowwise under inference_mode",
        _inference(F.linear),
        (_X3.transpose(1, 2).contiguous()[:, :, :4], _W[:, :4].contiguous()),
        ("S2", "S1"),
    ),
    Case(
        "a one-element plain tensor replicates",
        lambda s, t: s * t,
        (_X, torch.tensor([3.0])),
        ("S0", None),
    ),
]

# hp-dtensor runs the case; torch differs deliberately (README): placement, forward collectives
DIFFERENT: dict[str, Expected] = {
    # a Partial input an op needs whole is reduce-scattered into a Shard (fewer bytes than
    # torch's all-reduce to Replicate)
    "a product Partial scaled": ((("S", 0),), {"reduce_scatter": 1}),
    # a mean over batch shards stays Partial (one all-reduce of the total weight)
    "nll_loss2d of batch shards": ((("P", "sum"),), {"all_reduce": 1}),
    "nll_loss of a 3-D input": ((("P", "sum"),), {"all_reduce": 1}),
}
# torch raises or declines where hp-dtensor computes (values still checked)
TORCH_LACKS = frozenset({"as_strided as the identity view", "equal", "not equal"})


def _both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return run_cases_on_both(CASES, world_size)


@world_sizes(2, 4)
def test_ops_with_torch_rules_run_through_rules_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_both, world_size, world_size):
        assert_like_torch(ours, theirs, DIFFERENT, TORCH_LACKS)

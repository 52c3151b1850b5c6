"""Partial values propagate where torch propagates them, and cost what they cost in torch.

Ported from torch's ``test_pointwise_ops.py`` / ``test_matrix_ops.py`` /
``test_redistribute.py`` Partial cases. Each case runs on hp-dtensor and on
torch.distributed.tensor with the same inputs: output placements and collective
counts must match torch's (deliberate differences are named and listed in the
README), and values must match the same computation on full tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._torch_twin import (
    Case,
    Expected,
    Side,
    assert_like_torch,
    close,
    full,
    layout,
    run_cases_on_both,
    sides,
)

_G = torch.Generator().manual_seed(5)
_X = torch.randn(4, 6, generator=_G)
_W = torch.randn(6, 6, generator=_G)
_B = torch.randn(6, generator=_G)
_I = torch.arange(24).reshape(4, 6)
_T = torch.tensor([1, 2, 3, 0])

CASES = [
    Case("partial * 2", lambda p: p * 2, (_X,), ("P",), backward=True),
    Case("partial / 2", lambda p: p / 2, (_X,), ("P",)),
    Case("partial + partial", lambda p, q: p + q, (_X, _W[:4]), ("P", "P"), backward=True),
    Case("avg partial + avg partial", lambda p, q: p + q, (_X, _W[:4]), ("Pavg", "Pavg")),
    Case("avg partial * 3", lambda p: p * 3, (_X,), ("Pavg",)),
    Case("integer partial + integer partial", lambda p, q: p + q, (_I, _I), ("P", "P")),
    Case("integer partial * 2", lambda p: p * 2, (_I,), ("P",)),
    Case("partial @ replicate", lambda p, w: p @ w, (_X, _W), ("P", "R"), backward=True),
    Case("replicate @ partial", lambda x, p: x @ p, (_X, _W), ("R", "P")),
    Case("addmm(R, P, R)", torch.addmm, (_B, _X, _W), ("R", "P", "R")),
    Case("avg partial @ replicate", lambda p, w: p @ w, (_X, _W), ("Pavg", "R")),
    Case("maximum of max partials", torch.maximum, (_X, _W[:4]), ("Pmax", "Pmax")),
    Case("maximum of a max partial and a replicate", torch.maximum, (_X, _W[:4]), ("Pmax", "R")),
    Case(
        "shard -> Partial(sum)",
        # the value does not change: the one-process oracle is the identity
        lambda s: (
            s.redistribute(s.device_mesh, [_partial_of(s)]) if hasattr(s, "placements") else s
        ),
        (_X,),
        ("S0",),
    ),
    Case("softmax of a shard of the softmax dim", lambda s: torch.softmax(s, -1), (_X,), ("S1",)),
    Case(
        "log_softmax of a shard of the softmax dim",
        lambda s: torch.log_softmax(s, -1),
        (_X,),
        ("S1",),
    ),
    Case("softmax of a shard of another dim", lambda s: torch.softmax(s, -1), (_X,), ("S0",)),
    Case("cross_entropy of batch shards", F.cross_entropy, (_X, _T), ("S0", "S0")),
    Case("cross_entropy replicated", F.cross_entropy, (_X, _T), ("R", "R")),
]


def _partial_of(dt: Any) -> Any:
    """The Partial("sum") class of the DTensor's own implementation."""
    module = type(dt).__module__
    if module.startswith("torch"):
        import torch.distributed.tensor as tdt

        return tdt.Partial()
    import hyper_parallel.dtensor as hp

    return hp.Partial()


# Deliberate differences (README, "Differences from torch.distributed.tensor"): the output
# placement hp-dtensor gives, and the collectives it saves or adds, where torch differs.
DIFFERENT: dict[str, Expected] = {
    # softmax over a sharded dim stays sharded: the row max and sum are all-reduced in the
    # kernel (loss parallel); torch gathers the input.
    "softmax of a shard of the softmax dim": ((("S", 1),), {"all_reduce": 2}),
    "log_softmax of a shard of the softmax dim": ((("S", 1),), {"all_reduce": 2}),
    # a mean loss over batch shards stays Partial (each rank's sum over the global total
    # weight, one all-reduce of a scalar); torch all-reduces the loss itself.
    "cross_entropy of batch shards": ((("P", "sum"),), {"all_reduce": 1}),
}


def _both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return run_cases_on_both(CASES, world_size)


@world_sizes(2, 4)
def test_partial_propagates_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_both, world_size, world_size):
        assert_like_torch(ours, theirs, DIFFERENT)


def _seed_gradients(side: Side) -> dict[str, Any]:
    """``loss.backward()`` on a Partial or Replicate scalar: no collective for the seed."""
    out: dict[str, Any] = {}
    for kind in ("S0", "R"):
        x = side.distribute(_X.clone(), [side.Shard(0) if kind == "S0" else side.Replicate()])
        x.requires_grad_()
        loss = (x * 2).sum()
        with side.comm() as backward:
            loss.backward()
        assert x.grad is not None
        out[kind] = {
            "loss": layout(loss),
            "backward": backward,
            "grad": layout(x.grad),
            "grad_value": torch.equal(full(x.grad), torch.full_like(_X, 2.0)),
        }
    return out


@world_sizes(2, 4)
def test_backward_of_a_partial_or_replicate_scalar_loss_issues_no_collective(
    world_size: int,
) -> None:
    for ours, theirs in run_on_ranks(_seed_both, world_size, world_size):
        for kind in ("S0", "R"):
            assert ours[kind]["loss"] == theirs[kind]["loss"]
            assert ours[kind]["backward"] == theirs[kind]["backward"] == {}, (ours, theirs)
            # README, "Gradients": the leaf's gradient is laid out like the leaf (a local
            # slice of the replicated gradient torch leaves)
            assert ours[kind]["grad"] == ((("S", 0),) if kind == "S0" else (("R",),))
        assert ours["S0"]["loss"] == (("P", "sum"),)
        assert ours["S0"]["grad_value"] and ours["R"]["grad_value"]


def _seed_both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    ours, theirs = sides((world_size,))
    return _seed_gradients(ours), _seed_gradients(theirs)


def _partial_sources(side: Side) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, placement in (("sum", side.Partial()), ("avg", side.Partial("avg"))):
        with side.comm() as counts:
            dt = side.distribute(_X.clone(), [placement])
        out[f"distribute_tensor into Partial({name})"] = (layout(dt), dt.to_local(), full(dt))
        out[f"distribute comm {name}"] = counts
    p = side.from_local(torch.ones(2, 3), [side.Partial()])
    makers: dict[str, Callable[[], Any]] = {
        "zeros_like": lambda: torch.zeros_like(p),
        "ones_like": lambda: torch.ones_like(p),
        "full_like": lambda: torch.full_like(p, 2.0),
        "new_zeros": lambda: p.new_zeros((2, 3)),
        "empty_like then fill_": lambda: torch.empty_like(p).fill_(3.0),
        "new_empty then fill_": lambda: p.new_empty((2, 3)).fill_(3.0),
    }
    for name, make in makers.items():
        with side.comm() as counts:
            made = make()
        out[f"{name} of a Partial"] = (layout(made), float(full(made)[0, 0]), dict(counts))
    r = side.distribute(_X.clone(), [side.Replicate()])
    try:
        r.redistribute(side.mesh, [side.Partial()])
        out["Replicate -> Partial"] = "accepted"
    except RuntimeError:
        out["Replicate -> Partial"] = "RuntimeError"
    return out


def _sources_both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    ours, theirs = sides((world_size,))
    return _partial_sources(ours), _partial_sources(theirs)


@world_sizes(2, 4)
def test_distribute_tensor_into_partial_and_redistribute_to_partial_like_torch(
    world_size: int,
) -> None:
    for ours, theirs in run_on_ranks(_sources_both, world_size, world_size):
        for key, value in ours.items():
            want = theirs[key]
            if key.startswith("distribute comm"):
                want = {**want, "all_gather": 1}  # README: the shape/dtype check of every rank
                assert value == want, (key, value, theirs[key])
            elif key.endswith("of a Partial"):
                assert value == want, (key, value, want)
            elif isinstance(value, tuple):
                assert value[0] == want[0] and close(value[1], want[1]), (key, value, want)
                assert close(value[2], _X), key
            else:
                assert value == want, (key, value, want)

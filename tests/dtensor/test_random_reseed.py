"""Replicated random ops stay replicated when ranks reseed their generators after first use.

Everything runs in one launch of 4 ranks, one scenario after another in each process,
as a training script's calls would: torch's ``test_random_ops`` cases in sequence, a
per-rank ``torch.manual_seed`` after the mesh's first random op (dropout on a tensor
made ``Replicate()`` directly, or redistributed from a fresh sharded fill), dropout
inside a tensor-parallel attention block with ``dp``-rank and with per-rank seeds, and
initialisation after the same ``torch.manual_seed`` once all that has happened. Each
scenario runs on hp-dtensor and on torch.distributed.tensor over the same ranks
(placements compared; torch has no RNG tracker on CPU, so its values are not).

Oracles: the same calls on full tensors in one process after the seed of the mesh's
first rank (bitwise), and, across ranks, replicas holding equal values.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import Side, close, full, layout, sides
from torch import nn

import hyper_parallel.dtensor as hp

P_DROP = 0.4
DIM, HEADS, SEQ = 16, 4, 4


def _rank() -> int:
    return torch.distributed.get_rank()


def _port_sequence(side: Side) -> dict[str, Any]:
    """torch's ``test_deterministic_rand_1d``, a replicated ``uniform_``, then ``..._dropout_1d``."""
    world = side.mesh.size()
    S, R = side.Shard, side.Replicate
    out: dict[str, Any] = {}
    torch.manual_seed(0)  # what a test suite sets on every rank
    # torch's rand factory asserts without an RNG tracker (CPU): the same draw in place
    rand = side.distribute(torch.empty(4, 4 * world), [S(1)]).uniform_()
    out["rand_1d"] = (full(rand), layout(rand))
    uniform = side.distribute(torch.empty(world, 3), [R()])
    uniform.uniform_(0, 1)
    out["uniform_replicated"] = uniform.to_local().clone()
    # test_deterministic_dropout_1d: each rank its own seed, on the mesh used above
    torch.manual_seed(_rank())
    dt = side.distribute(torch.empty(4, 4), [S(1)])
    dt.uniform_(0, 1)
    dt = dt.redistribute(side.mesh, [R()])
    with warnings.catch_warnings(record=True) as caught, side.comm() as comm:
        warnings.simplefilter("always")
        dropped = nn.Dropout(p=0.2)(dt)
    out["dropout_input"] = dt.to_local().clone()
    out["dropout"] = dropped.to_local().clone()
    out["dropout_layout"] = layout(dropped)
    out["dropout_comm"] = comm
    out["warned"] = [type(w.message).__name__ for w in caught if "generator" in str(w.message)]
    return out


def _reseed_after_first_use(side: Side) -> dict[str, Any]:
    """The mesh's first random op with equal seeds, then per-rank seeds, then dropout of a Replicate."""
    S, R = side.Shard, side.Replicate
    torch.manual_seed(7)
    first = side.distribute(torch.empty(4, 4), [S(0), S(1)])
    first.uniform_()
    out: dict[str, Any] = {}
    torch.manual_seed(100 + _rank())
    direct = side.distribute(torch.ones(4, 4), [R(), R()])
    made: Any = F.dropout(direct, p=P_DROP, training=True)
    out["direct"] = (made.to_local().clone(), layout(made))
    torch.manual_seed(200 + _rank())
    fresh = side.distribute(torch.empty(4, 4), [S(0), S(1)])
    fresh.uniform_()
    moved = fresh.redistribute(side.mesh, [R(), R()])
    dropped: Any = F.dropout(moved, p=P_DROP, training=True)
    out["redistributed_input"] = moved.to_local().clone()
    out["redistributed"] = (dropped.to_local().clone(), layout(dropped))
    return out


def _one_rank_draws_alone(side: Side) -> dict[str, Any]:
    """Equal seeds; then rank 0 alone draws a plain tensor (nobody reseeds); then dropout of a Replicate.

    What a per-op check is for: a rank's generator moves on its own (rank 0 sampling
    examples to log, a data pipeline drawing per-rank sizes) with no reseed to detect, and
    only one rank knows; skipping the check on the ranks that saw no change would leave the
    others alone in a collective.
    """
    R = side.Replicate
    torch.manual_seed(9)
    side.distribute(torch.empty(4, 4), [R(), R()]).uniform_()  # checked: the replicas agree
    if _rank() == 0:
        torch.rand(5)
    replicated = side.distribute(torch.ones(4, 4), [R(), R()])
    with warnings.catch_warnings(record=True) as caught, side.comm() as comm:
        warnings.simplefilter("always")
        dropped: Any = F.dropout(replicated, p=P_DROP, training=True)
    return {
        "values": dropped.to_local().clone(),
        "comm": comm,
        "warned": any(isinstance(w.message, hp.RandomSeedWarning) for w in caught),
    }


class Attention(nn.Module):
    """Self-attention with dropout on the probabilities and on the output (a residual branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS), dim=-1)
        probs = F.dropout(probs, p=P_DROP, training=True)
        o = self.wo((probs @ v).transpose(1, 2).reshape(b, s, DIM))
        return F.dropout(o, p=P_DROP, training=True)  # type: ignore[no-any-return]


def _parallel(side: Side) -> Any:
    """``parallelize_module`` and the styles of the side's implementation."""
    name = "hyper_parallel.dtensor" if side.name == "hp" else "torch.distributed.tensor"
    return importlib.import_module(f"{name}.parallel")


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return Attention().state_dict()


def _batch(dp_rank: int) -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(50 + dp_rank))


def _tp_attention(side: Side, tp_mesh: Any, dp_rank: int) -> dict[str, Any]:
    """The block on ``tp_mesh`` (heads sharded), run after dp-rank seeds and after per-rank seeds."""
    parallel = _parallel(side)
    block = Attention()
    block.load_state_dict(_weights())
    parallel.parallelize_module(
        block,
        tp_mesh,
        {
            "w[qkv]": parallel.ColwiseParallel(use_local_output=False),
            "wo": parallel.RowwiseParallel(use_local_output=False),
        },
    )
    x = _batch(dp_rank)
    torch.manual_seed(3)
    block(x)  # the mesh's first random ops, equal seeds
    out: dict[str, Any] = {}
    for label, seed in (("dp-rank seeds", 1000 + dp_rank), ("per-rank seeds", 2000 + _rank())):
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught, side.comm() as comm:
            warnings.simplefilter("always")
            y = block(x)
        out[label] = {
            "local": y.to_local().clone(),
            "layout": layout(y),
            "comm": comm,
            "warned": any(isinstance(w.message, hp.RandomSeedWarning) for w in caught),
        }
    return out


def _init_after_all_that(side: Side, tp_mesh: Any) -> dict[str, Any]:
    """``torch.manual_seed`` on every rank, then TP init: the one-device values."""
    parallel = _parallel(side)
    torch.manual_seed(_rank())  # leftovers of a per-rank data pipeline
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM))
    parallel.parallelize_module(
        model, tp_mesh, {"0": parallel.ColwiseParallel(), "1": parallel.RowwiseParallel()}
    )
    torch.manual_seed(42)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in model:
            layer.reset_parameters()  # type: ignore[operator]
    return {
        "states": {n: full(p).detach().clone() for n, p in model.named_parameters()},
        "layouts": {n: layout(p) for n, p in model.named_parameters()},
        "warned": any(isinstance(w.message, hp.RandomSeedWarning) for w in caught),
    }


def _on_four_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torch: "random operators may not have complete support"
    result: dict[str, Any] = {}
    for side in sides((4,)):
        result[f"{side.name} port"] = _port_sequence(side)
    for side in sides((2, 2), ("dp", "tp")):
        dp_rank = side.mesh.get_local_rank("dp")
        result[f"{side.name} reseed"] = _reseed_after_first_use(side)
        if side.name == "hp":  # torch has no RNG tracker on CPU: its replicas may differ
            result["hp draws alone"] = _one_rank_draws_alone(side)
        result[f"{side.name} attention"] = _tp_attention(side, side.mesh["tp"], dp_rank)
        result[f"{side.name} init"] = _init_after_all_that(side, side.mesh["tp"])
    result["dp_rank"] = dp_rank
    return result


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_on_four_ranks, 4, timeout_s=240.0)


def test_port_sequence_dropout_1d_replicas_agree_after_earlier_cases(
    four_ranks: list[dict[str, Any]],
) -> None:
    torch.manual_seed(0)
    rand = torch.rand(4, 16)
    uniform = torch.empty(4, 3).uniform_(0, 1)
    first = four_ranks[0]["hp port"]
    for rank, got in enumerate(four_ranks):
        mine, theirs = got["hp port"], got["torch port"]
        assert torch.equal(mine["rand_1d"][0], rand), rank  # the one-device draw
        assert torch.equal(mine["uniform_replicated"], uniform), rank
        assert torch.equal(mine["dropout"], first["dropout"]), (rank, "replicas differ")
        assert mine["dropout_layout"] == theirs["dropout_layout"] == (("R",),)
        assert mine["rand_1d"][1] == theirs["rand_1d"][1]
        # the replicas' states are checked (one all-reduce) and, split by the per-rank
        # seeds, replaced by rank 0's (one broadcast) with a warning on the other ranks
        assert mine["dropout_comm"] == {"all_reduce": 1, "broadcast": 1}, mine["dropout_comm"]
        assert mine["warned"] == ([] if rank == 0 else ["RandomSeedWarning"]), (rank, mine)
    # rank 0's generator: its seed, then its own fill of the 16 shard elements' stream
    torch.manual_seed(0)
    torch.empty(4, 4).uniform_(0, 1)
    want = nn.Dropout(p=0.2)(first["dropout_input"])
    assert torch.equal(first["dropout"], want)


def test_per_rank_reseed_after_first_use_keeps_replicas_equal_both_variants(
    four_ranks: list[dict[str, Any]],
) -> None:
    torch.manual_seed(100)  # the mesh's first rank's seed
    direct = F.dropout(torch.ones(4, 4), p=P_DROP, training=True)
    for rank, got in enumerate(four_ranks):
        mine, theirs = got["hp reseed"], got["torch reseed"]
        for variant in ("direct", "redistributed"):
            assert mine[variant][1] == theirs[variant][1] == (("R",), ("R",)), variant
            assert torch.equal(mine[variant][0], four_ranks[0]["hp reseed"][variant][0]), (
                rank,
                variant,
                "replicas differ",
            )
        assert torch.equal(mine["direct"][0], direct), rank
    # redistributed: rank 0's generator after its own (seed 200) fill of the 16 elements
    first = four_ranks[0]["hp reseed"]
    torch.manual_seed(200)
    torch.empty(4, 4).uniform_()
    want = F.dropout(first["redistributed_input"], p=P_DROP, training=True)
    assert torch.equal(first["redistributed"][0], want)


def test_one_rank_drawing_alone_without_a_reseed_cannot_split_replicas(
    four_ranks: list[dict[str, Any]],
) -> None:
    torch.manual_seed(9)  # rank 0's generator, on one device
    torch.empty(4, 4).uniform_()
    torch.rand(5)
    want = F.dropout(torch.ones(4, 4), p=P_DROP, training=True)
    for rank, got in enumerate(four_ranks):
        mine = got["hp draws alone"]
        assert torch.equal(mine["values"], want), (rank, "replicas differ from rank 0's draw")
        assert "all_reduce" in mine["comm"] and "broadcast" in mine["comm"], mine["comm"]
        assert mine["warned"] == (rank != 0), rank


def test_dropout_in_tp_attention_with_dp_rank_seeds_is_the_one_device_block(
    four_ranks: list[dict[str, Any]],
) -> None:
    block = Attention()
    block.load_state_dict(_weights())
    for rank, got in enumerate(four_ranks):
        dp_rank = got["dp_rank"]
        tp_peer = four_ranks[rank ^ 1]  # the other rank of this rank's tp group
        for label in ("dp-rank seeds", "per-rank seeds"):
            mine, theirs = got["hp attention"][label], got["torch attention"][label]
            assert mine["layout"] == theirs["layout"] == (("R",),), label
            peer = tp_peer["hp attention"][label]["local"]
            assert torch.equal(mine["local"], peer), (rank, label, "tp replicas differ")
        dp_seeds = got["hp attention"]["dp-rank seeds"]
        # the tp ranks share a dp rank, hence a seed: the check passes, nothing is synced
        assert not dp_seeds["warned"] and "broadcast" not in dp_seeds["comm"], dp_seeds
        torch.manual_seed(1000 + dp_rank)
        want = block(_batch(dp_rank)).detach()
        assert close(dp_seeds["local"], want), (rank, "not the one-device block")
        per_rank = got["hp attention"]["per-rank seeds"]
        assert per_rank["warned"] == (rank % 2 == 1), (rank, per_rank)


def test_tp_init_after_reseeds_is_the_one_device_init(four_ranks: list[dict[str, Any]]) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM))
    want = dict(model.named_parameters())
    for rank, got in enumerate(four_ranks):
        mine, theirs = got["hp init"], got["torch init"]
        assert mine["layouts"] == theirs["layouts"]
        assert not mine["warned"], rank
        for name, value in mine["states"].items():
            assert torch.equal(value, want[name].detach()), (rank, name)

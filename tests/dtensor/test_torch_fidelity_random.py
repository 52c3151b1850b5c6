"""Random ops on DTensors: replicas agree and shards differ, as with torch's offset-based RNG tracker.

Ported from torch's ``test/distributed/tensor/test_random_ops.py`` (its cases run on
CUDA there; torch's DTensor has no RNG tracker on CPU). Every rank starts from its
own seed (``torch.manual_seed(rank)``), as in torch's ``test_deterministic_dropout_1d``;
the first random op on a mesh takes the state of the mesh's first rank. Oracles:

- the same calls on full tensors in one process after ``torch.manual_seed(0)`` (rank
  0's seed): each rank's shard is its slice of that draw, bitwise;
- across ranks: ranks holding the same shard hold equal values, ranks holding
  different shards hold different values;
- torch.distributed.tensor on the same inputs: output placements (values are not
  comparable, torch's CPU draws are per-rank).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import Side, layout, sides

import hyper_parallel.dtensor as hp
from hyper_parallel.dtensor._spec import local_shape_and_offset

Op = Callable[[Any], Any]

# Every random op a user reaches on a DTensor; each returns the drawn tensor.
OPS: dict[str, Op] = {
    "normal_": lambda t: t.normal_(0.5, 2.0),
    "uniform_": lambda t: t.uniform_(-1.0, 3.0),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(2.0),
    "random_": lambda t: t.random_(0, 100),
    "log_normal_": lambda t: t.log_normal_(),
    "cauchy_": lambda t: t.cauchy_(),
    "geometric_": lambda t: t.geometric_(0.3),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda t: torch.randint_like(t, 0, 100),
    "dropout": lambda t: F.dropout(t.fill_(1.0), p=0.4, training=True),
    "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
    "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.5),
}
SHAPE = (6, 8)
_KINDS = ("S0", "S1", "R")
LAYOUTS = list(itertools.product(_KINDS, _KINDS))  # every placement pair of a 2-D mesh


def _placements(side: Side, kinds: tuple[str, ...]) -> list[Any]:
    return [side.Replicate() if k == "R" else side.Shard(int(k[1])) for k in kinds]


def _draws(side: Side) -> dict[str, Any]:
    """Each op on each layout of a (2, 2) mesh: this rank's shard, its offset and the layout."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)  # per-rank seeds: the replicas must agree anyway
    out: dict[str, Any] = {}
    for kinds in LAYOUTS:
        for name, op in OPS.items():
            dt = side.distribute(torch.zeros(SHAPE), _placements(side, kinds))
            try:
                got = op(dt)
            except NotImplementedError:  # torch has no rule for some of them (random_)
                continue
            _, offset = local_shape_and_offset(
                SHAPE,
                (2, 2),
                tuple(side.mesh.get_coordinate()),
                tuple(hp.Replicate() if k == "R" else hp.Shard(int(k[1])) for k in kinds),
            )
            out[f"{name} {kinds}"] = (got.to_local().clone(), offset, layout(got))
    return out


def _fill_of_partial(side: Side) -> dict[str, str]:
    """An in-place fill or a dropout of a Partial DTensor raises, as in torch."""
    result: dict[str, str] = {}
    cases: dict[str, Op] = {
        "uniform_": lambda t: t.uniform_(),
        "normal_": lambda t: t.normal_(),
        "dropout": lambda t: F.dropout(t, p=0.5, training=True),
    }
    for name, op in cases.items():
        p = side.from_local(torch.ones(SHAPE), [side.Partial(), side.Replicate()])
        try:
            op(p)
            result[name] = "ran"
        except RuntimeError as exc:
            result[name] = "RuntimeError" + (
                " (names the fix)" if "redistribute" in str(exc).lower() else ""
            )
    return result


def _dropout_1d() -> dict[str, Any]:
    """torch's ``test_deterministic_dropout_1d``, on hp-dtensor, per-rank seeds."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    dt = hp.distribute_tensor(torch.empty(4, 4), mesh, [hp.Shard(1)])
    with warnings.catch_warnings(record=True) as caught, hp.CommDebugMode() as comm:
        warnings.simplefilter("always")
        dt.uniform_(0, 1)
    dt = dt.redistribute(mesh, [hp.Replicate()])
    dropped = torch.nn.Dropout(p=0.2)(dt)
    # a second op on the same mesh does not sync again: it checks that the replicas agree
    with hp.CommDebugMode() as second:
        torch.rand_like(dt)
    return {
        "uniform": dt.to_local().clone(),
        "dropout": dropped.to_local().clone(),
        "first_op_comm": comm.counts(),
        "second_op_comm": second.counts(),
        "warned": [type(w.message).__name__ for w in caught],
        "initial_seed": torch.initial_seed(),
    }


def hp_local(t: Any) -> torch.Tensor:
    """The local shard of an hp DTensor (a function: ``F.dropout`` is typed as a Tensor's)."""
    local: torch.Tensor = t.to_local()
    return local


def _rand_1d_and_manual_seed() -> dict[str, Any]:
    """torch's ``test_deterministic_rand_1d``, ``test_manual_seed`` and ``..._submesh``."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    with hp.CommDebugMode() as comm:
        hp.manual_seed(1234 + rank, mesh)  # trusted per-rank seeds: no sync, no collective
        sharded = hp.rand(4, 4 * world, device_mesh=mesh, placements=[hp.Shard(1)])
        hp.manual_seed(1234, mesh)
        replicated = hp.randn(4, 4 * world, device_mesh=mesh, placements=[hp.Replicate()])
    out["manual_seed_comm"] = comm.counts()
    out["sharded"] = sharded.to_local().clone()
    out["replicated"] = replicated.to_local().clone()
    out["seed"] = torch.initial_seed()
    # vouched-for seeds (#35): dropout of a Replicate issues no collective, its replicas agree
    ones = hp.distribute_tensor(torch.ones(8, 8), mesh, [hp.Replicate()])
    with hp.CommDebugMode() as dropout_comm:
        dropped = [hp_local(F.dropout(ones, p=0.5, training=True)) for _ in range(3)]
    out["dropout_comm"] = dropout_comm.counts()
    out["dropout"] = torch.stack(dropped)
    # torch's test_init_with_user_generator: a generator seeded like the default one
    # draws the same values, and both advance
    t1 = hp.empty(8, 3, device_mesh=mesh, placements=[hp.Shard(0)])
    t2 = hp.empty(8, 3, device_mesh=mesh, placements=[hp.Shard(0)])
    torch.manual_seed(42)
    rng = torch.Generator().manual_seed(42)
    same = []
    for _ in range(2):
        torch.nn.init.uniform_(t1, 0.0, 1.0)
        torch.nn.init.uniform_(t2, 0.0, 1.0, rng)
        same.append(torch.equal(t1.full_tensor(), t2.full_tensor()))
    out["user_generator_same"] = same
    # torch's test_pipeline_parallel_manual_seed: one seed per stage of a (pp, spmd) mesh
    world_mesh = hp.init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "spmd"))
    spmd = world_mesh["spmd"]
    hp.manual_seed(123 + world_mesh.get_local_rank("pp"), spmd)
    stage = hp.ones(2 * spmd.size(), 2, device_mesh=spmd, placements=[hp.Shard(0)])
    torch.nn.init.normal_(stage)
    out["pipeline_local"] = stage.to_local().clone()
    outside = hp.DeviceMesh("cpu", [(rank + 1) % world])
    try:
        hp.manual_seed(rank, outside)
        out["outside"] = "ran"
    except RuntimeError as exc:
        out["outside"] = str(exc)
    return out


def _multinomial(side: Side) -> dict[str, Any]:
    """torch's ``test_multinomial_sharded`` (both kinds of sampling): rows stay sharded."""
    probs = torch.rand(8, 4, generator=torch.Generator().manual_seed(3))
    probs = probs / probs.sum(-1, keepdim=True)
    out: dict[str, Any] = {}
    for kinds in (("S0", "R"), ("S1", "R"), ("R", "S0")):
        for replacement in (True, False):
            dt = side.distribute(probs, _placements(side, kinds))
            torch.manual_seed(11)
            # column shards are not shard-local: hp takes its gather fallback there (README)
            with hp.strict_mode(str(kinds[0]) != "S1"), side.comm() as comm:
                got: Any = torch.multinomial(dt, 2, replacement=replacement)
            torch.manual_seed(11)
            want = torch.multinomial(probs, 2, replacement=replacement)
            out[f"{kinds} {replacement}"] = {
                "layout": layout(got),
                "comm": comm,
                "exact": torch.equal(got.full_tensor(), want),
            }
    return out


def _meta_init() -> dict[str, Any]:
    """torch's ``test_meta_tensor_init`` and ``test_tp_model_meta_init`` on CPU."""
    import hyper_parallel.dtensor.parallel as tp

    torch.manual_seed(0)
    world = torch.distributed.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,))
    meta_dt = hp.distribute_tensor(torch.empty(16, 8, device="meta"), mesh, [hp.Replicate()])
    out: dict[str, Any] = {"is_meta": meta_dt.is_meta, "meta_layout": layout(meta_dt)}
    filled: Any = torch.empty_like(meta_dt, device="cpu")
    filled.uniform_()
    out["replicated_fill"] = filled.to_local().clone()
    with torch.device("meta"):
        model = torch.nn.Linear(world, world, bias=False)
        tp.parallelize_module(model, mesh, tp.ColwiseParallel())
    out["parallelized_on_meta"] = model.weight.is_meta
    model.to_empty(device="cpu")
    model.reset_parameters()
    out["weight_type"] = type(model.weight.data).__name__
    weight: Any = model.weight
    out["weight_local"] = weight.to_local().detach().clone()
    return out


def _on_four_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.simplefilter(
        "ignore"
    )  # torch: "random operators may not have complete support on cpu"
    ours, theirs = sides((2, 2))
    result: dict[str, Any] = {
        "hp": _draws(ours),
        "torch_layouts": {k: v[2] for k, v in _draws(theirs).items()},
        "hp_partial": _fill_of_partial(ours),
        "torch_partial": _fill_of_partial(theirs),
        "hp_multinomial": _multinomial(ours),
        "torch_multinomial": _multinomial(theirs),
    }
    result["dropout_1d"] = _dropout_1d()
    result["rand_1d"] = _rand_1d_and_manual_seed()
    result["meta"] = _meta_init()
    return result


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_on_four_ranks, 4, timeout_s=240.0)


def _oracle() -> dict[str, torch.Tensor]:
    """Each draw of :func:`_draws` on one device, after rank 0's seed."""
    torch.manual_seed(0)
    return {
        f"{name} {kinds}": op(torch.zeros(SHAPE)).clone()
        for kinds in LAYOUTS
        for name, op in OPS.items()
    }


def test_every_random_op_on_every_2d_layout_is_the_one_device_draw(
    four_ranks: list[dict[str, Any]],
) -> None:
    want = _oracle()
    for rank, got in enumerate(four_ranks):
        for key, (local, offset, _) in got["hp"].items():
            piece = want[key]
            for d, (start, length) in enumerate(zip(offset, local.shape, strict=True)):
                piece = piece.narrow(d, start, length)
            assert torch.equal(local, piece), (rank, key)


def test_replicas_agree_and_shards_differ_on_a_2d_mesh(four_ranks: list[dict[str, Any]]) -> None:
    for key in four_ranks[0]["hp"]:
        by_offset: dict[tuple[int, ...], torch.Tensor] = {}
        for got in four_ranks:
            local, offset, _ = got["hp"][key]
            offset = tuple(offset)
            if offset in by_offset:
                assert torch.equal(by_offset[offset], local), (key, offset, "replicas differ")
            by_offset[offset] = local
        if "bernoulli" in key or "dropout" in key:
            continue  # few values: two shards may draw the same pattern by chance
        shards = list(by_offset.values())
        for a, b in itertools.combinations(shards, 2):
            assert a.shape != b.shape or not torch.equal(a, b), (key, "shards agree")


def test_random_ops_keep_torch_placements(four_ranks: list[dict[str, Any]]) -> None:
    for got in four_ranks:
        assert len(got["torch_layouts"]) >= len(got["hp"]) - len(LAYOUTS)  # all but random_
        for key, placements in got["torch_layouts"].items():
            assert placements == got["hp"][key][2], key


def test_random_fill_of_a_partial_raises_like_torch(four_ranks: list[dict[str, Any]]) -> None:
    for got in four_ranks:
        assert set(got["torch_partial"].values()) == {"RuntimeError"}, got["torch_partial"]
        assert set(got["hp_partial"].values()) == {"RuntimeError (names the fix)"}


def test_deterministic_dropout_1d_per_rank_seeds(four_ranks: list[dict[str, Any]]) -> None:
    first = four_ranks[0]["dropout_1d"]
    for rank, got in enumerate(four_ranks):
        run = got["dropout_1d"]
        assert torch.equal(run["uniform"], first["uniform"]), rank
        assert torch.equal(run["dropout"], first["dropout"]), rank
        # the first random op on the mesh syncs the state: one broadcast, once
        assert run["first_op_comm"] == {"broadcast": 1}, run["first_op_comm"]
        assert run["second_op_comm"] == {"all_reduce": 1}, run["second_op_comm"]
        assert run["warned"] == ([] if rank == 0 else ["RandomSeedWarning"]), (rank, run)
        assert run["initial_seed"] == 0, "the state (and its seed) of rank 0"
    torch.manual_seed(0)  # rank 0's seed, on one device
    uniform = torch.empty(4, 4).uniform_(0, 1)
    assert torch.equal(first["uniform"], uniform)
    assert torch.equal(first["dropout"], torch.nn.Dropout(p=0.2)(uniform))


def test_deterministic_rand_1d_and_manual_seed(four_ranks: list[dict[str, Any]]) -> None:
    runs = [got["rand_1d"] for got in four_ranks]
    for rank, run in enumerate(runs):
        assert run["manual_seed_comm"] == {}, run["manual_seed_comm"]
        assert torch.equal(run["replicated"], runs[0]["replicated"])
        assert run["seed"] == 1234
        assert run["dropout_comm"] == {}, run["dropout_comm"]
        assert torch.equal(run["dropout"], runs[0]["dropout"]), (rank, "replicas differ")
        assert not torch.equal(run["dropout"][0], run["dropout"][1])  # drawn, not constant
        assert "manual_seed requires the current rank to be a part of the device mesh" in str(
            run["outside"]
        ), run["outside"]
        assert run["user_generator_same"] == [True, True]
        for other in runs[rank + 1 :]:
            assert not torch.equal(run["sharded"], other["sharded"])
            assert not torch.equal(run["pipeline_local"], other["pipeline_local"])


def test_multinomial_of_row_shards_stays_sharded(four_ranks: list[dict[str, Any]]) -> None:
    for got in four_ranks:
        for key, mine in got["hp_multinomial"].items():
            theirs = got["torch_multinomial"][key]
            assert mine["exact"], (key, "not the one-device samples")
            if "S1" in key:
                # a shard of the classes is gathered, as torch (which then also splits the
                # rows over the replicated axis; hp's fallback returns Replicate, so its
                # seed check covers both axes: one all-reduce each)
                assert theirs["comm"] == {"all_gather": 1}, (key, theirs)
                assert mine["comm"] == {"all_gather": 1, "all_reduce": 2}, (key, mine)
                continue
            assert mine["layout"] == theirs["layout"], (key, mine, theirs)
            # no data moves, as torch; hp checks that the replicated axis's ranks agree
            assert theirs["comm"] == {}, (key, theirs)
            assert mine["comm"] == {"all_reduce": 1}, (key, mine)


def test_meta_init_then_to_empty(four_ranks: list[dict[str, Any]]) -> None:
    locals_ = [got["meta"]["weight_local"] for got in four_ranks]
    for got in four_ranks:
        meta = got["meta"]
        assert meta["is_meta"] and meta["meta_layout"] == (("R",),)
        assert torch.equal(meta["replicated_fill"], four_ranks[0]["meta"]["replicated_fill"])
        assert meta["parallelized_on_meta"]
        assert meta["weight_type"] == "DTensor"
    for a, b in itertools.combinations(locals_, 2):
        assert not torch.equal(a, b), "ColwiseParallel shards were initialised alike"

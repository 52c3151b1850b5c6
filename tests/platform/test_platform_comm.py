"""Out-of-place collectives of the torch adapter on real gloo groups, against one-process oracles.

Each rank builds deterministic inputs from its rank (``_inputs``); the test
recomputes every expected output from the inputs of all ranks in one process.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from tests._harness import run_on_ranks, world_sizes

from hyper_parallel.platform_torch import TorchPlatform, comm
from hyper_parallel.platform_torch.comm import ReduceOpName

PLATFORM = TorchPlatform()
OPS: tuple[ReduceOpName, ...] = ("sum", "avg", "max", "min")
EXACT_OPS: tuple[ReduceOpName, ...] = ("sum", "max", "min")
CHUNK = (3, 2)
# Collectives with an equivalent built from others, forced on the second pass.
FALLBACKS = ("all_gather_into_tensor", "reduce_scatter", "all_to_all_single")


def _inputs(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's inputs; the non-contiguous ones are transposes of contiguous tensors."""
    gen = torch.Generator().manual_seed(1000 + rank)
    floats = torch.randn(world_size, *CHUNK, generator=gen)
    ints = torch.randint(-50, 50, (world_size, *CHUNK), generator=gen)
    return {
        "float": floats[0],
        "int": ints[0],
        "float_t": torch.randn(CHUNK[1], CHUNK[0], generator=gen).t(),  # non-contiguous
        "stacked": floats,
        "stacked_int": ints,
        "stacked_t": torch.randn(world_size, CHUNK[1], CHUNK[0], generator=gen).transpose(1, 2),
    }


def _run_collectives(world_size: int) -> dict[str, torch.Tensor]:
    """Every collective on the world group, then again with the fallback paths forced."""
    rank = dist.get_rank()
    x = _inputs(rank, world_size)
    for name in ("float_t", "stacked_t"):
        assert not x[name].is_contiguous()
    snapshot = {name: t.clone() for name, t in x.items()}
    out: dict[str, torch.Tensor] = {}
    for path in ("native", "fallback"):
        if path == "fallback":
            comm._UNSUPPORTED.update((dist.get_backend(), name) for name in FALLBACKS)
        out[f"{path}/all_gather"] = PLATFORM.all_gather(x["float"], None)
        out[f"{path}/all_gather_t"] = PLATFORM.all_gather(x["float_t"], None)
        out[f"{path}/all_gather_int"] = PLATFORM.all_gather(x["int"], None)
        for op in OPS:
            out[f"{path}/all_reduce_{op}"] = PLATFORM.all_reduce(x["float_t"], None, op)
            out[f"{path}/reduce_scatter_{op}"] = PLATFORM.reduce_scatter(x["stacked_t"], None, op)
        for op in EXACT_OPS:
            out[f"{path}/all_reduce_int_{op}"] = PLATFORM.all_reduce(x["int"], None, op)
            out[f"{path}/reduce_scatter_int_{op}"] = PLATFORM.reduce_scatter(
                x["stacked_int"], None, op
            )
        out[f"{path}/all_to_all"] = PLATFORM.all_to_all(x["stacked"], None)
        out[f"{path}/all_to_all_t"] = PLATFORM.all_to_all(x["stacked_t"], None)
    for name, t in x.items():  # out of place: inputs untouched
        assert torch.equal(t, snapshot[name]), name
    src = world_size - 1
    out["broadcast"] = PLATFORM.broadcast(x["float_t"], None, src)
    assert out["broadcast"].data_ptr() != x["float_t"].data_ptr()
    chunks = list(x["stacked_t"].unbind(0)) if rank == src else None
    out["scatter"] = PLATFORM.scatter(chunks, torch.empty(CHUNK), None, src)
    return out


def _oracle(world_size: int) -> dict[str, torch.Tensor]:
    """Every expected output of every rank, computed in this one process."""
    per_rank = [_inputs(r, world_size) for r in range(world_size)]

    def stack(name: str) -> torch.Tensor:
        return torch.stack([inputs[name] for inputs in per_rank])

    reduce: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sum": lambda t: t.sum(0),
        "avg": lambda t: t.mean(0),
        "max": lambda t: t.amax(0),
        "min": lambda t: t.amin(0),
    }
    expected: dict[str, torch.Tensor] = {
        "all_gather": stack("float"),
        "all_gather_t": stack("float_t"),
        "all_gather_int": stack("int"),
        "broadcast": per_rank[-1]["float_t"],
    }
    for op, fn in reduce.items():
        expected[f"all_reduce_{op}"] = fn(stack("float_t"))
        expected[f"reduce_scatter_{op}"] = fn(stack("stacked_t"))  # (world, world, *CHUNK)
        if op != "avg":
            expected[f"all_reduce_int_{op}"] = fn(stack("int"))
            expected[f"reduce_scatter_int_{op}"] = fn(stack("stacked_int"))
    expected["all_to_all"] = stack("stacked")  # [src, dst, ...]
    expected["all_to_all_t"] = stack("stacked_t")
    expected["scatter"] = per_rank[-1]["stacked_t"]
    return expected


def _expected_on(rank: int, key: str, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    if key.startswith(("reduce_scatter", "scatter")):
        return expected[key][rank]
    if key.startswith("all_to_all"):
        return expected[key][:, rank]
    return expected[key]


@world_sizes()
def test_every_collective_matches_the_one_process_oracle(world_size: int) -> None:
    results = run_on_ranks(_run_collectives, world_size, world_size)
    expected = _oracle(world_size)
    for rank, out in enumerate(results):
        for key, got in out.items():
            name = key.split("/")[-1]
            want = _expected_on(rank, name, expected)
            assert got.is_contiguous(), key
            assert got.dtype == want.dtype, key
            torch.testing.assert_close(got, want, msg=f"rank {rank}, {key}")


def _run_on_subgroup() -> dict[str, object]:
    """Collectives on a subgroup listed out of order: ranks [3, 1] (group ranks 0, 1)."""
    rank = dist.get_rank()
    groups = [PLATFORM.new_group([3, 1]), PLATFORM.new_group([0, 2])]
    group = groups[0] if rank in (3, 1) else groups[1]
    mine = torch.tensor([float(rank)])
    return {
        "gathered": PLATFORM.all_gather(mine, group).flatten().tolist(),
        "broadcast_from_group_rank_1": PLATFORM.broadcast(mine, group, 1).item(),
        "to_all": PLATFORM.all_to_all(torch.stack([mine * 10, mine * 10 + 1]), group)
        .flatten()
        .tolist(),
        "scattered": PLATFORM.scatter(
            [torch.tensor([float(rank)]), torch.tensor([rank + 0.5])] if rank in (3, 0) else None,
            torch.empty(1),
            group,
            0,
        ).item(),
    }


def test_collectives_use_group_local_ranks_in_the_order_given_to_new_group() -> None:
    results = run_on_ranks(_run_on_subgroup, 4)
    members = {0: [0, 2], 1: [3, 1], 2: [0, 2], 3: [3, 1]}
    for rank, out in enumerate(results):
        group = members[rank]
        position = group.index(rank)
        assert out["gathered"] == [float(r) for r in group]
        assert out["broadcast_from_group_rank_1"] == float(group[1])
        assert out["to_all"] == [10.0 * r + position for r in group]
        assert out["scattered"] == group[0] + 0.5 * position


def _invalid_calls() -> None:
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"group_size=2.*got \(3, 4\)"):
        PLATFORM.reduce_scatter(torch.ones(3, 4), None, "sum")
    with pytest.raises(ValueError, match=r"group_size=2.*got \(\)"):
        PLATFORM.all_to_all(torch.tensor(1.0), None)
    with pytest.raises(ValueError, match=r"src must be a group rank in \[0, 2\), got 2"):
        PLATFORM.broadcast(torch.ones(1), None, 2)
    if rank == 0:
        with pytest.raises(ValueError, match="must pass 2 chunks, got 1 chunks"):
            PLATFORM.scatter([torch.ones(1)], torch.empty(1), None, 0)
        with pytest.raises(ValueError, match=r"chunk 1 has shape \(2,\).*expected \(1,\)"):
            PLATFORM.scatter([torch.ones(1), torch.ones(2)], torch.empty(1), None, 0)
    with pytest.raises(ValueError, match=r"distinct, got \[1, 1\]"):
        PLATFORM.new_group([1, 1])
    with pytest.raises(ValueError, match=r"\[0, 2\).*got \[5\]"):
        PLATFORM.new_group([0, 5])


def test_invalid_collective_arguments_raise_before_communicating() -> None:
    run_on_ranks(_invalid_calls, 2)


def test_avg_of_integers_and_unknown_reduce_ops_are_rejected() -> None:
    with pytest.raises(TypeError, match=r"'avg'.*floating-point.*torch.int64"):
        PLATFORM.all_reduce(torch.ones(2, dtype=torch.int64), None, "avg")
    with pytest.raises(TypeError, match=r"'avg'.*floating-point.*torch.int32"):
        PLATFORM.reduce_scatter(torch.ones(1, 2, dtype=torch.int32), None, "avg")
    with pytest.raises(ValueError, match=r"\('sum', 'avg', 'product', 'max', 'min'\), got 'prod'"):
        PLATFORM.all_reduce(torch.ones(2), None, "prod")  # type: ignore[arg-type]


def test_process_group_calls_without_a_group_say_how_to_get_one() -> None:
    assert not PLATFORM.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        PLATFORM.get_rank()


def test_init_process_group_without_rendezvous_env_names_the_missing_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"missing \('MASTER_ADDR', 'MASTER_PORT', 'RANK'"):
        PLATFORM.init_process_group("cpu")

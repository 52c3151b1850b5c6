"""fully_shard's API on 2 ranks: accumulation, mixed precision, the methods, the bad inputs.

Oracles: one process on the global batch (accumulated micro-batches equal one big
batch), torch's ``fully_shard`` on the same ranks (bf16 mixed precision, collective
counts of an accumulating backward), and the model before a failed call (bad input
leaves it unchanged).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dtensor import _fsdp_cases as cases
from tests.dtensor._tp_examples import HP, TORCH, Api, collective_counts
from torch import nn

import hyper_parallel.dtensor as hp_dt
from hyper_parallel.dtensor.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    HSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)


def _accumulate(api: Api) -> dict[str, Any]:
    """Two micro-batches, the first without gradient sync: the global batch's gradients."""
    torch.manual_seed(0)
    model = cases.Model()
    mesh = cases.apply(api, model, (2,), "fsdp")
    xs, ys = cases.global_batch()
    rank = mesh.get_local_rank(0)
    x, y = xs[0, rank * 4 : rank * 4 + 4], ys[0, rank * 4 : rank * 4 + 4]
    counts = []
    for micro, sync in ((0, False), (1, True)):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        with api.comm_debug_mode() as comm:
            half = slice(micro * 2, micro * 2 + 2)
            (nn.functional.mse_loss(model(x[half]), y[half]) / 2).backward()  # type: ignore[no-untyped-call]
        counts.append(collective_counts(comm))
        if not sync:
            assert all(p.grad is None for p in model.parameters())
    grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters()}
    return {"counts": counts, "grads": {n: g.full_tensor() for n, g in grads.items()}}


def _mixed_precision(api: Api) -> dict[str, Any]:
    torch.manual_seed(0)
    model = cases.Model()
    mp: Any = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if api is TORCH:
        mp = torch.distributed.fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    mesh = cases.apply(api, model, (2,), "fsdp", mp_policy=mp)
    xs, ys = cases.global_batch()
    rank = mesh.get_local_rank(0)
    with api.comm_debug_mode() as comm:
        out = model(xs[0, rank * 4 : rank * 4 + 4])
        nn.functional.mse_loss(out.float(), ys[0, rank * 4 : rank * 4 + 4]).backward()  # type: ignore[no-untyped-call]
    params: dict[str, Any] = dict(model.named_parameters())
    result: dict[str, Any] = {
        "out_dtype": out.dtype,
        "param_dtypes": {p.dtype for p in params.values()},
        "grad_dtypes": {p.grad.dtype for p in params.values()},
        "grads": {n: p.grad.full_tensor() for n, p in params.items()},
        "counts": collective_counts(comm),
    }
    if api is HP:
        result["gather_bytes"] = comm.bytes()["all_gather"]
    return result


def _methods() -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = cases.Model()
    cases.apply(HP, model, (2,), "fsdp")
    block: Any = model.blocks[0]
    out["classes"] = (type(model).__name__, isinstance(model, FSDPModule), HSDPModule is FSDPModule)
    with hp_dt.CommDebugMode() as comm:
        handle = block.unshard(async_op=True)
    out["handle"] = isinstance(handle, UnshardHandle)
    handle.wait()
    out["unsharded"] = (type(block.w1.weight).__name__, tuple(block.w1.weight.shape))
    out["unshard_counts"] = comm.counts()
    block.reshard()
    out["resharded"] = type(block.w1.weight).__name__
    # the root stays unsharded after forward; its state_dict still holds sharded DTensors
    xs, ys = cases.global_batch()
    model(xs[0, :4])
    out["state_dict_types"] = {type(v).__name__ for v in model.state_dict().values()}
    # sums instead of averages: twice the averaged gradient on 2 ranks
    torch.manual_seed(0)
    summed = cases.Model()
    cases.apply(HP, summed, (2,), "fsdp")
    summed.set_reduce_op_type("sum")  # type: ignore[operator]
    nn.functional.mse_loss(summed(xs[0, :4]), ys[0, :4]).backward()  # type: ignore[no-untyped-call]
    torch.manual_seed(0)
    averaged = cases.Model()
    cases.apply(HP, averaged, (2,), "fsdp")
    nn.functional.mse_loss(averaged(xs[0, :4]), ys[0, :4]).backward()  # type: ignore[no-untyped-call]
    pairs = zip(summed.parameters(), averaged.parameters(), strict=True)
    out["sum_over_avg"] = [
        (s.grad.full_tensor(), a.grad.full_tensor() * 2)  # type: ignore[union-attr]
        for s, a in pairs
    ]

    # Shard(1) placements, CPU offload and no reshard after forward: the same gradients
    def grads_of(**kwargs: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        torch.manual_seed(0)
        m = cases.Model()
        cases.apply(HP, m, (2,), "fsdp", **kwargs)
        nn.functional.mse_loss(m(xs[0, :4]), ys[0, :4]).backward()  # type: ignore[no-untyped-call]
        named: dict[str, Any] = dict(m.named_parameters())
        return (
            {n: p.grad.full_tensor() for n, p in named.items()},
            {n: str(p.placements) for n, p in named.items()},
        )

    out["default_grads"], _ = grads_of()
    out["shard1"] = grads_of(
        shard_placement_fn=lambda p: hp_dt.Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None
    )
    out["offload"] = grads_of(offload_policy=CPUOffloadPolicy(pin_memory=False))
    out["no_reshard"] = grads_of(reshard_after_forward=False)
    # ignored parameters stay plain tensors: neither sharded nor reduced
    torch.manual_seed(0)
    ignoring = cases.Model()
    head: Any = ignoring.head.weight
    fully_shard(ignoring, mesh=hp_dt.init_device_mesh("cpu", (2,)), ignored_params={head})
    out["ignored_type"] = type(ignoring.head.weight).__name__
    # a registered forward method all-gathers like forward
    torch.manual_seed(0)
    model = cases.Model()
    cases.apply(HP, model, (2,), "fsdp")
    model.head_only = lambda h: model.head(h)  # type: ignore[assignment,operator]
    register_fsdp_forward_method(model, "head_only")
    with hp_dt.CommDebugMode() as comm:
        model.head_only(torch.ones(2, 8))  # type: ignore[operator]
    out["method_counts"] = comm.counts()
    return out


def _params_of(model: nn.Module) -> list[tuple[str, int, str]]:
    return [(n, id(p), type(p).__name__) for n, p in model.named_parameters()]


def _errors() -> dict[str, Any]:
    out: dict[str, str] = {}
    mesh = hp_dt.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

    def error(fn: Any, model: nn.Module) -> str:
        before = _params_of(model)
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as e:
            assert _params_of(model) == before, "a failed call changed the model"
            return f"{type(e).__name__}: {e}"
        raise AssertionError("no error")

    model = cases.Model()
    fully_shard(model.head, mesh=mesh)
    out["twice"] = error(lambda: fully_shard(model.head, mesh=mesh), model)
    cube = hp_dt.init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    model = cases.Model()
    out["mesh_3d"] = error(lambda: fully_shard(model, mesh=cube), model)
    out["reshard_int"] = error(
        lambda: fully_shard(model, mesh=mesh, reshard_after_forward=3), model
    )
    stray = {nn.Parameter(torch.ones(2))}
    out["ignored"] = error(lambda: fully_shard(model, mesh=mesh, ignored_params=stray), model)
    shared = cases.Model()
    blocks: Any = shared.blocks
    blocks[1].w1.weight = blocks[0].w1.weight
    fully_shard(shared.blocks[0], mesh=mesh)
    out["shared"] = error(lambda: fully_shard(shared.blocks[1], mesh=mesh), shared)
    early = cases.Model()
    opt = torch.optim.SGD(early.parameters(), lr=0.1)
    fully_shard(early, mesh=mesh)
    early(torch.ones(2, 6)).sum().backward()
    out["early_optimizer"] = error(opt.step, early)
    return out


def _api_on_two_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {f"accumulate/{api.name}": _accumulate(api) for api in (HP, TORCH)}
    out.update({f"mp/{api.name}": _mixed_precision(api) for api in (HP, TORCH)})
    out["methods"] = _methods()
    out["errors"] = _errors()
    one = cases.Model
    torch.manual_seed(0)
    model = one()
    xs, ys = cases.global_batch()
    nn.functional.mse_loss(model(xs[0]), ys[0]).backward()  # type: ignore[no-untyped-call]
    out["one_grads"] = {n: p.grad for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_api_on_two_ranks, 2, timeout_s=300)


def test_accumulation_without_sync_equals_the_global_batch(two_ranks: list[dict[str, Any]]) -> None:
    for got in two_ranks:
        for side in ("hp", "torch"):
            run = got[f"accumulate/{side}"]
            for n, g in got["one_grads"].items():
                assert_close_to_scale(run["grads"][n], g, what=f"{side} accumulated {n}")
        # the unsynced backward re-gathers but reduces nothing; hp counts as torch does
        assert got["accumulate/hp"]["counts"] == got["accumulate/torch"]["counts"]
        assert "reduce_scatter" not in got["accumulate/hp"]["counts"][0]
        assert got["accumulate/hp"]["counts"][1]["reduce_scatter"] == 3


def test_bf16_mixed_precision_as_torch(two_ranks: list[dict[str, Any]]) -> None:
    for got in two_ranks:
        hp, tt = got["mp/hp"], got["mp/torch"]
        assert hp["out_dtype"] == tt["out_dtype"] == torch.bfloat16
        assert hp["param_dtypes"] == hp["grad_dtypes"] == {torch.float32}
        assert hp["counts"] == tt["counts"]
        for n, g in tt["grads"].items():
            assert_close_to_scale(hp["grads"][n], g, rel=2e-2, what=f"bf16 grad {n}")
        # parameters all-gathered in bf16: 2 bytes per padded element
        assert hp["gather_bytes"] % 2 == 0


def test_methods_and_upstream_names(two_ranks: list[dict[str, Any]]) -> None:
    for got in two_ranks:
        m = got["methods"]
        assert m["classes"] == ("FSDPModel", True, True)
        assert m["handle"] is True
        assert m["unsharded"] == ("Parameter", (10, 8))
        assert m["unshard_counts"] == {"all_gather": 1}
        assert m["resharded"] == "DTensor"
        assert m["state_dict_types"] == {"DTensor"}
        for summed, doubled in m["sum_over_avg"]:
            assert_close_to_scale(summed, doubled)
        assert m["method_counts"] == {"all_gather": 1}
        w1 = "blocks.0.w1.weight"  # (10, 8): sharded on dim 1 by shard_placement_fn
        assert (
            m["shard1"][1][w1] == "(Shard(dim=1),)"
            and m["shard1"][1]["blocks.0.w1.bias"] == "(Shard(dim=0),)"
        )
        for variant in ("shard1", "offload", "no_reshard"):
            for n, g in m["default_grads"].items():
                assert_close_to_scale(m[variant][0][n], g, what=f"{variant} grad {n}")
        assert m["ignored_type"] == "Parameter"


def test_bad_input_names_what_was_expected_and_changes_nothing(
    two_ranks: list[dict[str, Any]],
) -> None:
    errors = two_ranks[0]["errors"]
    assert "already applied" in errors["twice"] and "Linear" in errors["twice"]
    assert "3-D mesh" in errors["mesh_3d"] and "('a', 'b', 'c')" in errors["mesh_3d"]
    assert "reshard_after_forward=3" in errors["reshard_int"] and "'dp'" in errors["reshard_int"]
    assert "ignored_params" in errors["ignored"] and "(2,)" in errors["ignored"]
    assert "'weight'" in errors["shared"] and "one fully_shard([a, b]) call" in errors["shared"]
    assert "build the optimizer after fully_shard" in errors["early_optimizer"]

"""The bench baselines against the single-device oracle, on 2 real gloo ranks."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from bench.common.comm_count import CollectiveCounter
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig, loss_and_grads, make_batch, make_full_weights
from bench.common.runner import load_factory
from tests._tolerance import assert_close_to_scale
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.platform_torch.launch import run_distributed

TINY = LlamaConfig(vocab=48, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, seq=8, batch=2)
FACTORIES = {
    "megatron": "bench.baselines.megatron:build_megatron_step",
    "torch_tp": "bench.baselines.torch_tp:build_torch_tp_step",
}


class OneStep(NamedTuple):
    """One rank's view of one train step of a baseline."""

    loss: float
    grads: dict[str, torch.Tensor]
    counts: dict[str, int]  # by bench.common.comm_count.CollectiveCounter
    torch_counts: dict[str, int]  # by torch's CommDebugMode


def _one_step_each(cfg: LlamaConfig, seed: int) -> dict[str, OneStep]:
    """On every rank: one step of each baseline; its loss, full grads and collective counts."""
    ctx = TPContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group=dist.group.WORLD,  # type: ignore[arg-type]
        torch_mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)),
    )
    weights = make_full_weights(cfg, seed)
    tokens, targets = make_batch(cfg, seed)
    out: dict[str, OneStep] = {}
    for name, path in FACTORIES.items():
        step = load_factory(path)(cfg, weights, ctx)
        with CollectiveCounter() as counter, CommDebugMode() as torch_counter:  # type: ignore[no-untyped-call]
            loss = step.forward_loss(tokens, targets)
            torch.autograd.backward(loss)
        torch_counts = {str(op): n for op, n in torch_counter.get_comm_counts().items()}
        out[name] = OneStep(
            float(loss.detach()), step.full_grads(), dict(counter.counts), torch_counts
        )
    return out


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, OneStep]]:
    return run_distributed(_one_step_each, 2, args=(TINY, 7), timeout_s=120)


@pytest.mark.parametrize("impl", list(FACTORIES))
def test_baseline_loss_and_grads_equal_single_device_on_every_rank(
    two_rank_results: list[dict[str, OneStep]], impl: str
) -> None:
    ref_loss, ref_grads = loss_and_grads(TINY, make_full_weights(TINY, 7), *make_batch(TINY, 7))
    for rank, result in enumerate(two_rank_results):
        loss, grads = result[impl].loss, result[impl].grads
        assert loss == pytest.approx(float(ref_loss), rel=1e-5), f"rank {rank}"
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            assert_close_to_scale(grads[name], ref, what=f"{impl} {name}")


@pytest.mark.parametrize("impl", list(FACTORIES))
def test_baseline_issues_megatron_minimum_all_reduces(
    two_rank_results: list[dict[str, OneStep]], impl: str
) -> None:
    counts, torch_counts = two_rank_results[0][impl].counts, two_rank_results[0][impl].torch_counts
    # 2 forward + 2 backward all-reduces per block and nothing else (no sequence parallel)
    assert counts == {"all_reduce": 4 * TINY.n_layers}
    # torch's CommDebugMode, an independent counter, sees the same number of all-reduces
    # (c10d ops from Megatron's f/g, functional collectives from torch's DTensor)
    assert set(torch_counts) <= {"c10d.allreduce_", "c10d_functional.all_reduce"}
    assert sum(torch_counts.values()) == 4 * TINY.n_layers

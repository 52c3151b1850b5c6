"""``hp-train --plan``: the layouts it proposes are the dry run's, under budget; its search rules; its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.train._jobs import TINY_MODEL

from hyper_parallel.train.cli import main
from hyper_parallel.train.config import JobConfig, load_job
from hyper_parallel.train.plan import Measured, NoLayoutError, PlanRequest, enumerate_layouts, plan
from hyper_parallel.train.plan_cost import (
    MATMUL_EFFICIENCY,
    Layout,
    ModelFacts,
    estimate_step,
    model_facts,
)
from hyper_parallel.train.plan_devices import DEVICES, Device
from hyper_parallel.train.trainer import build_model_config

GIB = 2**30


def _dry_run_bytes(job: JobConfig, world: int) -> int:
    """The oracle: a dry run of its own (no cache shared with the planner)."""
    from hyper_parallel.train.dry_run import dry_run

    return dry_run(job, world).max_total_bytes


def _facts(*overrides: str) -> tuple[JobConfig, ModelFacts]:
    job = JobConfig().apply_overrides(list(overrides))
    return job, model_facts(build_model_config(job, 257), job.training.seq_len)


def test_plan_proposes_only_layouts_the_dry_run_puts_under_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a budget that the plain replicas (dp_replicate=2, no checkpointing) exceed
    job = JobConfig().apply_overrides(TINY_MODEL)
    replicas = _dry_run_bytes(Layout(dp_replicate=2, local_batch_size=2).apply(job), 2)
    budget_gib = 0.97 * replicas / GIB
    out = tmp_path / "best.toml"
    argv = [*(f"--{o}" for o in TINY_MODEL), "--plan", "--world-size=2", "--json"]
    argv += [f"--device-memory={budget_gib!r}", f"--plan-out={out}", "--plan-top=2"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)  # the one JSON object, nothing else
    fitting = [c for c in report["candidates"] if c["fits"]]
    assert fitting and report["candidates"][: len(fitting)] == fitting  # fits ranked first
    times = [c["estimated_step_seconds"] for c in fitting]
    assert times == sorted(times)
    for c in fitting:
        layout = Layout(
            **c["parallelism"],
            activation_checkpoint=c["activation_checkpoint"],
            pipeline_microbatches=c["pipeline_microbatches"],
            local_batch_size=c["local_batch_size"],
            gradient_accumulation_steps=c["gradient_accumulation_steps"],
        )
        measured = _dry_run_bytes(layout.apply(job), 2)
        assert measured <= budget_gib * GIB
        assert abs(measured - c["max_total_bytes"]) <= 0.01 * measured
    assert all(
        c["max_total_bytes"] > budget_gib * GIB for c in report["candidates"] if not c["fits"]
    )
    # --plan-out: the best layout as a job hp-train --config runs, the same bytes in --dry-run
    written = load_job(out)
    best = fitting[0]
    assert {k: getattr(written.parallelism, k) for k in best["parallelism"]} == best["parallelism"]
    assert written.parallelism.activation_checkpoint == best["activation_checkpoint"]
    again = _dry_run_bytes(written, 2)
    assert abs(again - best["max_total_bytes"]) <= 0.01 * again


def test_plan_refuses_a_model_that_fits_nowhere_naming_the_smallest_need(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*(f"--{o}" for o in TINY_MODEL), "--plan", "--world-size=2", "--device-memory=1e-6"]
    assert main([*argv, "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["candidates"] and not any(c["fits"] for c in report["candidates"])
    assert "nothing fits in 1e-06 GiB per rank on 2 ranks" in captured.err
    # the smallest it names is the least of the measured layouts, in the dry run's bytes
    smallest = report["candidates"][0]
    assert smallest["max_total_bytes"] == min(c["max_total_bytes"] for c in report["candidates"])
    layout = Layout(
        **smallest["parallelism"],
        activation_checkpoint=smallest["activation_checkpoint"],
        local_batch_size=smallest["local_batch_size"],
        gradient_accumulation_steps=smallest["gradient_accumulation_steps"],
    )
    want = _dry_run_bytes(layout.apply(JobConfig().apply_overrides(TINY_MODEL)), 2)
    shown = f"{want / GIB:.2f} GiB" if want >= GIB / 10 else f"{want / 2**20:.2f} MiB"
    assert f"the smallest per-rank memory found is {shown}" in captured.err
    assert layout.describe() in captured.err
    assert main(argv) == 1
    assert "(no layout fits)" in capsys.readouterr().out


def test_plan_never_proposes_ep_without_experts_nor_cp_without_context_parallelism() -> None:
    job, facts = _facts("model.name=qwen3-ref", "model.flavor=debug")
    layouts, _ = enumerate_layouts(job, facts, 4)
    assert layouts and all(x.ep == 1 and x.etp == 1 and x.cp == 1 for x in layouts)
    moe_job, moe = _facts("model.name=qwen3-ref", "model.flavor=debug-moe")
    moe_layouts, _ = enumerate_layouts(moe_job, moe, 4)
    assert {x.ep for x in moe_layouts} == {1, 2, 4} and all(x.cp == 1 for x in moe_layouts)
    llama_job, llama = _facts()  # llama-ref has context parallelism: cp is searched
    assert {x.cp for x in enumerate_layouts(llama_job, llama, 4)[0]} == {1, 2, 4}


def test_plan_keeps_tp_and_cp_inside_a_node_unless_nothing_else_fits() -> None:
    job, facts = _facts()
    request = PlanRequest(4, 80.0, DEVICES["h100"], gpus_per_node=2, top=50)

    def anything(candidate: JobConfig, world: int) -> Measured:
        return Measured(1, 1, (0,))

    result = plan(job, request, facts, memory=anything)
    assert result.best is not None
    assert all(c.layout.tp * c.layout.cp <= 2 for c in result.candidates)

    def only_across(candidate: JobConfig, world: int) -> Measured:
        par = candidate.parallelism
        need = 1 if par.tp * par.cp == 4 else 100 * GIB
        return Measured(need, 1, (0,))

    best = plan(job, request, facts, memory=only_across).best
    assert best is not None and best.layout.tp * best.layout.cp == 4


def test_step_estimate_is_the_hand_count_of_compute_tp_and_bubble() -> None:
    facts = ModelFacts(10**9, 0, 6e9, 16, 0, 2048, 16, 16, 128, 0, 0, True)
    job = JobConfig().apply_overrides(
        ["training.seq_len=1024", "training.global_batch_size=8", "training.param_dtype=bfloat16"]
    )
    device = Device("x", 100.0, 80.0, 8, 100.0, 10.0)
    layout = Layout(tp=2, pp=2, pipeline_microbatches=4, local_batch_size=8)
    e = estimate_step(facts, layout, job, device, 8)
    tokens = 8 * 1024
    compute = 6e9 * tokens / 4 / (100e12 * MATMUL_EFFICIENCY)
    # 8 blocks per stage, 4 reductions of (batch 8 x 1024 tokens x 2048 x 2 bytes) each,
    # 2 x (tp - 1) / tp of them per device, at 100 GB/s
    tp = 8 * 4 * 2 * 0.5 * tokens * 2048 * 2 / 100e9
    pp = 2 * tokens * 2048 * 2 / 100e9
    assert e.compute_seconds == pytest.approx(compute)
    assert e.comm_seconds["tp"] == pytest.approx(tp)
    assert e.bubble == pytest.approx(1 / 4)
    assert e.seconds == pytest.approx((compute + tp + pp) * 1.25)
    full = estimate_step(facts, Layout(dp_shard=4, activation_checkpoint="full"), job, device, 8)
    assert full.compute_seconds == pytest.approx(compute * 4 / 3)  # the forward recomputed


def test_plan_bad_input_names_the_flag_and_what_was_found(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tiny = [f"--{o}" for o in TINY_MODEL]
    assert main([*tiny, "--plan", "--device-memory=80"]) == 2
    assert "--world-size: expected --world-size N" in capsys.readouterr().err
    assert main([*tiny, "--plan", "--world-size=2"]) == 2
    assert "--device-memory: expected --device-memory GIB" in capsys.readouterr().err
    assert main([*tiny, "--plan", "--world-size=2", "--device-memory=80", "--device=tpu"]) == 2
    assert "--device: expected one of" in capsys.readouterr().err
    # 7 ranks: 2 heads, 1 layer, a batch of 4: no factoring of 7 suits the model
    assert main([*tiny, "--plan", "--world-size=7", "--device-memory=80"]) == 2
    err = capsys.readouterr().err
    assert "expected a world size some layout of 'llama-ref'" in err and "found 7" in err
    assert "tp=7: n_heads (2)" in err and "pp=7: more stages than the model's 1 layers" in err
    # the same, called as a function: a prime world above the heads, layers and batch
    job, facts = _facts()
    with pytest.raises(NoLayoutError, match=r"found 5: .*tp=5: n_heads \(4\)"):
        plan(job, PlanRequest(5, 80.0, DEVICES["h100"]), facts)

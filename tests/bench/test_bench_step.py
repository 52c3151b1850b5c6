"""``bench/step_bench.py`` end to end on a tiny config, 2 ranks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from bench.baselines.megatron import MegatronStep
from bench.common.harness import TPContext
from bench.common.llama import LlamaConfig

from bench import step_bench

TINY_ARGS = ["--world-sizes", "2", "--dims", "32", "--heads", "4", "--kv-heads", "2"]
TINY_ARGS += ["--layers", "2", "--seq", "8", "--batch", "2", "--vocab", "48"]
TINY_ARGS += ["--iters", "3", "--warmup", "1", "--timeout-s", "60"]


def build_off_by_one_percent(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> MegatronStep:
    """A wrong implementation: Megatron on an output projection scaled by 1.01."""
    weights = dict(full_weights)
    weights["output.weight"] = weights["output.weight"] * 1.01
    return MegatronStep(cfg, weights, ctx)


def build_failing_on_rank_1(
    cfg: LlamaConfig, full_weights: Mapping[str, torch.Tensor], ctx: TPContext
) -> MegatronStep:
    """An implementation whose construction raises on rank 1 only."""
    if ctx.rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    return MegatronStep(cfg, full_weights, ctx)


def test_step_bench_times_both_baselines_with_parity_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert step_bench.main([*TINY_ARGS, "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    (result,) = payload["results"]
    assert result["world_size"] == 2 and result["config"]["dim"] == 32
    for name in ("megatron", "torch_tp"):
        entry = result["impls"][name]
        assert entry["status"] == "ok" and entry["parity_ok"], entry
        assert 0 < entry["min_ms"] <= entry["median_ms"]
        assert entry["comm_forward"] == {"all_reduce": 4} == entry["comm_backward"]
    assert result["impls"]["megatron"]["ratio_vs_megatron"] == 1.0
    assert result["impls"]["torch_tp"]["ratio_vs_torch_tp"] == 1.0
    assert result["impls"]["megatron"]["min_ratio_vs_megatron"] == 1.0


def test_step_bench_optimizer_steps_every_implementation_inside_the_timed_step(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    argv = [*TINY_ARGS, "--optimizer", "--only", "megatron", "torch_tp", "ours_user_model"]
    assert step_bench.main([*argv, "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["meta"]["optimizer"].startswith("AdamW(lr=1e-4, foreach=True)")
    assert payload["meta"]["timing"].endswith("+AdamW(foreach) step")
    impls = payload["results"][0]["impls"]
    for name in ("megatron", "torch_tp", "ours_user_model"):  # torch_tp: DTensors and plain
        entry = impls[name]
        assert entry["status"] == "ok" and entry["parity_ok"], entry
        # the profiled optimizer step ran, on this implementation's own parameters
        assert entry["optimizer_calls"] > 0, entry
    # hp's step runs foreach ops on DTensors: each dispatches, so it makes more calls
    assert impls["ours_user_model"]["optimizer_calls"] > impls["megatron"]["optimizer_calls"]


def test_step_bench_flags_wrong_and_failing_implementations_and_skips_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    here = Path(__file__).stem
    monkeypatch.setattr(
        step_bench,
        "IMPLEMENTATIONS",
        {
            "megatron": "bench.baselines.megatron:build_megatron_step",
            "wrong": f"{here}:build_off_by_one_percent",
            "failing": f"{here}:build_failing_on_rank_1",
            "missing": "no_such_bench_module:build",
        },
    )
    out = tmp_path / "bench.json"
    assert step_bench.main([*TINY_ARGS, "--json", str(out)]) == 1
    payload = json.loads(out.read_text())
    impls = payload["results"][0]["impls"]
    assert impls["megatron"]["parity_ok"]
    assert impls["wrong"]["status"] == "ok" and not impls["wrong"]["parity_ok"]
    assert impls["wrong"]["grad_max_abs_diff"] > 1e-4
    assert impls["failing"]["status"] == "error"
    assert (
        "deliberate failure" in impls["failing"]["error"]
        or "another rank" in impls["failing"]["error"]
    )
    assert "missing" in payload["skipped"] and "missing" not in impls
    printed = capsys.readouterr().out
    assert "PARITY FAILED" in printed and "skipped missing" in printed


def test_step_bench_table_columns_align_for_long_names(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = LlamaConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, seq=8, batch=1)
    entry: dict[str, Any] = {
        "status": "ok",
        "parity_ok": True,
        "median_ms": 1.0,
        "min_ms": 0.5,
        "grad_max_abs_diff": 1e-7,
        "loss_abs_diff": 0.0,
        "python_calls": 400,
        "calls_vs_megatron": 1.0,
        "comm_forward": {"all_reduce": 2},
        "comm_backward": {"all_reduce": 2},
    }
    for base in ("megatron", "torch_tp"):
        entry[f"ratio_vs_{base}"] = entry[f"min_ratio_vs_{base}"] = 1.0
    step_bench.print_table(1, cfg, {"megatron": entry, "ours_tp_api_no_overlap": dict(entry)})
    lines = capsys.readouterr().out.splitlines()
    ours = [line for line in lines if "ours_tp_api_no_overlap" in line]
    megatron = [line for line in lines if line.split()[:1] == ["megatron"]]
    assert len(ours) == len(megatron) == 3, lines  # timings, calls, collectives
    for short, long in zip(megatron, ours, strict=True):
        # the first figure after the name starts in the same column on both rows
        second = short.split()[1]
        assert short.index(second, len("   megatron")) == long.index(
            long.split()[1], len("   ours_tp_api_no_overlap")
        ), (short, long)

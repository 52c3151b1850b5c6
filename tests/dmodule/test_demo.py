"""The demo end to end: 2 ranks, 2 steps, tiny config; and a crashed rank ending it quickly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.vocab_size=64", "--model.ffn_dim=48"]


ROOT = Path(__file__).resolve().parents[2]


def _demo(
    args: list[str], module: str = "hyper_parallel.dmodule.demo"
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )


def test_demo_two_ranks_two_steps_passes_parity_and_writes_plot(tmp_path: Path) -> None:
    plot = tmp_path / "curve.png"
    done = _demo(["--tp", "2", "--steps", "2", "--seq-len", "8", "--plot", str(plot), *TINY])
    assert done.returncode == 0, done.stdout + done.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = done.stdout
    assert "sharding plan" in out and "tok_embeddings" in out and "Shard(dim=0)" in out
    assert "collectives per training step" in out and "all_reduce" in out
    assert "PASS" in out


def test_demo_crashed_rank_exits_nonzero_quickly_with_the_cause(tmp_path: Path) -> None:
    start = time.monotonic()
    done = _demo(
        ["--steps", "3", "--seq-len", "8", "--plot", str(tmp_path / "p.png"), *TINY],
        module="tests.dmodule._demo_crash",  # rank 1 raises at step 2 (a test-only fault)
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert "demo FAILED" in done.stderr and "injected crash on rank 1 at step 2" in done.stderr
    assert "every rank process was stopped" in done.stderr
    assert not (tmp_path / "p.png").exists()
    assert elapsed < 200


def test_demo_rejects_bad_options_before_starting_ranks() -> None:
    done = _demo(["--dp", "3", "--batch-size", "8"])
    assert done.returncode == 2
    assert "--batch-size 8 must divide by --dp 3" in done.stderr
    done = _demo(["--model.dimm=3"])
    assert done.returncode == 2


def test_demo_resumes_from_a_checkpoint_on_another_mesh_and_keeps_parity(tmp_path: Path) -> None:
    ckpt, plot = tmp_path / "ckpt", tmp_path / "resumed.png"
    common = ["--seq-len", "8", "--checkpoint-dir", str(ckpt), *TINY]
    first = _demo(["--tp", "2", "--steps", "2", "--checkpoint-every", "1", *common])
    assert first.returncode == 0, first.stdout + first.stderr
    assert (ckpt / "step-1").is_dir() and (ckpt / "step-2").is_dir()
    resumed = _demo(
        ["--tp", "1", "--dp", "2", "--steps", "3", "--resume", "--plot", str(plot), *common]
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    out = resumed.stdout
    assert "resumed from" in out and "step-2" in out and "onto tp=1 dp=2" in out
    assert "resumed at step 3" in out and "PASS" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ckpt / "step-3").is_dir()


def test_demo_resume_without_a_checkpoint_is_refused_before_starting_ranks(tmp_path: Path) -> None:
    done = _demo(["--resume", "--checkpoint-dir", str(tmp_path)])
    assert done.returncode == 2
    assert "no committed checkpoint" in done.stderr


def test_demo_fsdp_x_tp_keeps_parity_and_resumes_onto_another_fsdp_mesh(tmp_path: Path) -> None:
    ckpt, plot = tmp_path / "ckpt", tmp_path / "fsdp.png"
    common = ["--seq-len", "8", "--checkpoint-dir", str(ckpt), "--plot", str(plot), *TINY]
    first = _demo(
        ["--tp", "2", "--dp-shard", "2", "--steps", "2", "--checkpoint-every", "1", *common]
    )
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "[Shard(dim=0), Shard(dim=1)]" in out  # a Rowwise weight on (dp_shard, tp)
    assert "reduce_scatter" in out and "all_gather" in out and "PASS" in out
    assert "parameters + gradients + optimizer state per rank" in out
    resumed = _demo(["--tp", "1", "--dp-shard", "2", "--steps", "3", "--resume", *common])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 3" in resumed.stdout and "PASS" in resumed.stdout


def test_plan_table_widens_the_placement_column_for_a_2d_placement() -> None:
    """FSDP x TP's placements (the issue's row) stay in their column, apart from the shape."""
    from hyper_parallel.dmodule.demo_report import plan_table

    wide = "[_StridedShard(dim=0, sf=2), Shard(dim=0)]"
    plan = [
        ("tok_embeddings", "weight", wide, (256, 64), (64, 64)),
        ("layers.0.attention.wq", "weight", "[Shard(dim=0)]", (64, 64), (32, 64)),
        ("norm", "weight", "(plain tensor)", (64,), (64,)),
    ]
    lines = plan_table(plan)
    header = ["module", "param", "placement", "global shape", "local shape"]
    rows = [header, *[[m, n, p, str(full), str(local)] for m, n, p, full, local in plan]]
    # the header's words mark where each column starts; every line's cells start there,
    # each followed by spaces only, at least two before the next column
    starts = [lines[0].index(word) for word in header]
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        assert line[: starts[0]] == "  "
        ends = [*starts[1:], len(line)]
        for cell, start, end in zip(row, starts, ends, strict=True):
            assert line[start:end].rstrip() == cell, (line, cell)
        for cell, start, end in zip(row[:-1], starts[:-1], ends[:-1], strict=True):
            assert end - start - len(cell) >= 2, (line, cell)
    assert starts[3] - starts[2] == len(wide) + 2  # the widest placement sets its column

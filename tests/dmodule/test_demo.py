"""The demo end to end: 2 ranks, 2 steps, tiny config; and a crashed rank ending it quickly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.vocab_size=64", "--model.ffn_dim=48"]


def _demo(
    args: list[str], env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "hyper_parallel.dmodule.demo", *args],
        capture_output=True,
        text=True,
        env=env,
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
        {"HP_DEMO_CRASH_RANK": "1", "HP_DEMO_CRASH_STEP": "2"},
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


def test_demo_flag_without_a_value_is_a_usage_error() -> None:
    done = _demo(["--tp", "2", "--model.dim"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: --model.dim: expected a value ('--model.dim=VALUE' or '--model.dim VALUE')" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


STALL = {"HP_DEMO_STALL_RANK": "1", "HP_DEMO_STALL_STEP": "2"}


def test_demo_stalled_rank_is_named_with_stacks_by_the_built_in_launcher(tmp_path: Path) -> None:
    start = time.monotonic()
    args = ["--steps", "3", "--seq-len", "8", "--timeout", "20", "--plot", str(tmp_path / "p.png")]
    done = _demo([*args, *TINY], STALL)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert "demo FAILED" in err and "timed out after 20 s" in err
    assert "ranks [1] did not arrive at the collective that ranks [0] wait in" in err
    assert "rank 1 did not arrive at a collective: it is at " in err and "in train_rank" in err
    assert "--- rank 0 Python stack" in err and "--- rank 1 Python stack" in err
    assert elapsed < 200


def test_demo_stalled_rank_under_torchrun_ends_at_the_timeout_naming_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(STALL)
    start = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *("-m", "hyper_parallel.dmodule.demo", "--tp", "2", "--steps", "3", "--seq-len", "8"),
            *("--timeout", "20", "--plot", str(tmp_path / "p.png"), *TINY),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    elapsed = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "[rank 1] stall watchdog: no end after 20 s; rank 1 did not arrive" in out
    assert "[rank 0] stall watchdog: no end after 20 s; rank 0 waits in torch.distributed" in out
    assert "ranks [1] did not arrive at the collective the others wait in" in out
    assert "in train_rank" in out  # each rank's Python stack
    assert elapsed < 20 + 120  # not the process group's timeout (20 s + 60 s margin)

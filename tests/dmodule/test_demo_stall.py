"""The demo's usage errors and stalled ranks (#12 item 11): named, with stacks, within the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.dim=32", "--model.n_layers=1", "--model.vocab_size=64", "--model.ffn_dim=48"]
RUN = ["--tp", "2", "--steps", "3", "--seq-len", "8", "--timeout", "20"]


def _run(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    return done, time.monotonic() - start


def test_demo_flag_without_a_value_is_a_usage_error() -> None:
    done, _ = _run(["-m", "hyper_parallel.dmodule.demo", "--tp", "2", "--model.dim"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: --model.dim: expected a value ('--model.dim=VALUE' or '--model.dim VALUE')" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_demo_stalled_rank_is_named_with_stacks_by_the_built_in_launcher(tmp_path: Path) -> None:
    plot = ["--plot", str(tmp_path / "p.png")]
    done, elapsed = _run(["-m", "tests.dmodule._demo_stall", *RUN, *plot, *TINY])
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert "demo FAILED" in err and "timed out after 20 s" in err
    assert "ranks [1] did not arrive at the collective that ranks [0] wait in" in err
    assert "rank 1 did not arrive at a collective: it is at " in err and "in after_step" in err
    assert "--- rank 0 Python stack" in err and "--- rank 1 Python stack" in err
    assert not (tmp_path / "p.png").exists()
    assert elapsed < 200


def test_demo_stalled_rank_under_torchrun_ends_at_the_timeout_naming_it(tmp_path: Path) -> None:
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    plot = ["--plot", str(tmp_path / "p.png")]
    done, elapsed = _run([*torchrun, "-m", "tests.dmodule._demo_stall", *RUN, *plot, *TINY])
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "[rank 1] stall watchdog: no end after 20 s; rank 1 did not arrive" in out
    assert "[rank 0] stall watchdog: no end after 20 s; rank 0 waits in torch.distributed" in out
    assert "ranks [1] did not arrive at the collective the others wait in" in out
    assert "in after_step" in out and "in train_rank" in out  # each rank's Python stack
    # ended by the watchdog, not by a collective's timeout (20 s + the 60 s margin)
    assert "Timed out" not in out and elapsed < 200

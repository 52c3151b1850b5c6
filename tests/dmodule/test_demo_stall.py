"""The demo's usage errors and stalled ranks (#12 item 11): named, with stacks, within the timeout."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.dmodule._demo_stall import MARKER_ENV

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.dim=32", "--model.n_layers=1", "--model.vocab_size=64", "--model.ffn_dim=48"]
# The demo's --timeout counts from launch: on a loaded machine starting the ranks and
# running step 1 can take most of it, and a stall that begins too late (or not at all)
# tests nothing. So each stall test starts with a short timeout and, only when the stall
# began less than STALL_LEAD_S before it ran out, runs again with a longer one; every
# assertion holds for the run whose stall did begin in time.
TIMEOUTS_S = (20, 60, 120)
STALL_LEAD_S = 8.0


def _run(
    argv: list[str], env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    start = time.monotonic()
    wall_start = time.time()
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    return done, time.monotonic() - start, wall_start


def _run_stalled(
    launcher: list[str], tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """The stalled demo, with the first timeout whose stall began well before it ran out."""
    for attempt, timeout in enumerate(TIMEOUTS_S):
        marker = tmp_path / f"stall-began-{attempt}"
        plot = ["--plot", str(tmp_path / "p.png")]
        run = ["--tp", "2", "--steps", "3", "--seq-len", "8", "--timeout", str(timeout)]
        done, elapsed, wall_start = _run(
            [*launcher, "-m", "tests.dmodule._demo_stall", *run, *plot, *TINY],
            {MARKER_ENV: str(marker)},
        )
        began = float(marker.read_text()) - wall_start if marker.exists() else math.inf
        if began <= timeout - STALL_LEAD_S:
            return done, elapsed, timeout
    raise AssertionError(
        f"the stall never began {STALL_LEAD_S} s before the demo's timeout, even with "
        f"{TIMEOUTS_S[-1]} s; last output:\n{done.stdout}{done.stderr}"
    )


def test_demo_flag_without_a_value_is_a_usage_error() -> None:
    done, _, _ = _run(["-m", "hyper_parallel.dmodule.demo", "--tp", "2", "--model.dim"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: --model.dim: expected a value ('--model.dim=VALUE' or '--model.dim VALUE')" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(sum(TIMEOUTS_S) + 240)  # every attempt, on a loaded machine
def test_demo_stalled_rank_is_named_with_stacks_by_the_built_in_launcher(tmp_path: Path) -> None:
    done, elapsed, timeout = _run_stalled([], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    err = done.stderr
    assert "demo FAILED" in err and f"timed out after {timeout} s" in err, err
    assert "ranks [1] did not arrive at the collective that ranks [0] wait in" in err, err
    assert "rank 1 did not arrive at a collective: it is at " in err and "in after_step" in err
    assert "--- rank 0 Python stack" in err and "--- rank 1 Python stack" in err
    assert not (tmp_path / "p.png").exists()
    assert elapsed < timeout + 180


@pytest.mark.timeout(sum(TIMEOUTS_S) + 240)
def test_demo_stalled_rank_under_torchrun_ends_at_the_timeout_naming_it(tmp_path: Path) -> None:
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done, elapsed, timeout = _run_stalled(torchrun, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"[rank 1] stall watchdog: no end after {timeout} s; rank 1 did not arrive" in out
    assert (
        f"[rank 0] stall watchdog: no end after {timeout} s; rank 0 waits in torch.distributed"
        in out
    )
    assert "ranks [1] did not arrive at the collective the others wait in" in out
    assert "in after_step" in out and "in train_rank" in out  # each rank's Python stack
    # ended by the watchdog, not by a collective's timeout (the timeout + the 60 s margin)
    assert "Timed out" not in out and elapsed < timeout + 180

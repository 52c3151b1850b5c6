"""Stopping a run by a signal, asynchronous checkpoints and the profiler, each resumed exactly.

``hp-train`` on its built-in launcher (2 ranks, the tiny model): first in a subprocess, a
Ctrl-C as a terminal sends it (SIGINT to the launcher's whole process group); then,
resumed with this process as the launcher, a SIGTERM to the launcher's pid alone. Each
stops every rank after its step with one committed checkpoint of that step. One in-process launch then gives the
oracle (the same job uninterrupted) and runs a job with ``checkpoint.async_save`` and
``[profiling]``, resumed after its last asynchronous checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import TINY_MODEL, tiny_job, write_corpus

from hyper_parallel.dmodule.checkpoint import latest_step
from hyper_parallel.train.cli import main
from hyper_parallel.train.trainer import RunSummary, train

LAYOUT = ["parallelism.dp_shard=2"]
#: more steps than a test waits for: the run ends by the signal
ENDLESS = 100_000


def _command_line(root: Path, corpus: Path) -> list[str]:
    options = [
        *TINY_MODEL,
        *LAYOUT,
        f"data.path={corpus}",
        f"training.steps={ENDLESS}",
        "training.timeout=240",
        f"checkpoint.dir={root / 'ckpt'}",
        f"metrics.jsonl={root / 'metrics.jsonl'}",
    ]
    return [f"--{o}" for o in options]


def _launch(root: Path, corpus: Path, name: str) -> subprocess.Popen[bytes]:
    """``python -m hyper_parallel.train`` in a session of its own (its own process group)."""
    with (root / f"{name}.out").open("wb") as out, (root / f"{name}.err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "hyper_parallel.train", *_command_line(root, corpus)],
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _logged_steps(root: Path) -> list[dict[str, Any]]:
    path = root / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in records if "loss" in r]


def _wait_for_a_step_past(after: int, root: Path, running: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 240
    while not any(r["step"] > after for r in _logged_steps(root)):
        if not running() or time.monotonic() > deadline:
            raise AssertionError(f"hp-train logged no step past {after}")
        time.sleep(0.05)


def _ctrl_c_after_a_step(process: subprocess.Popen[bytes], root: Path) -> int:
    """Once a step is logged, SIGINT to the launcher's process group (what a terminal's Ctrl-C
    does); the exit status."""
    try:
        _wait_for_a_step_past(0, root, lambda: process.poll() is None)
        os.killpg(process.pid, signal.SIGINT)
        return process.wait(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _sigterm_to_this_process_after(after: int, root: Path, done: threading.Event) -> None:
    """Once a step past ``after`` is logged, SIGTERM to this process alone (the launcher here)."""
    _wait_for_a_step_past(after, root, lambda: not done.is_set())
    os.kill(os.getpid(), signal.SIGTERM)


def _in_process(corpus: str, root: str, steps: int) -> dict[str, Any] | None:
    """The same job uninterrupted; a job saving asynchronously and profiled, resumed."""
    full = train(tiny_job(Path(corpus), *LAYOUT, f"training.steps={steps}"), log=False)
    asynchronous = [
        *LAYOUT,
        f"checkpoint.dir={root}/async",
        "checkpoint.interval=2",
        "checkpoint.async_save=true",
        f"profiling.dir={root}/profile",
        "profiling.start_step=2",
        "profiling.end_step=3",
    ]
    first = train(tiny_job(Path(corpus), *asynchronous, "training.steps=4"), log=False)
    committed = sorted(p.name for p in Path(root, "async").iterdir())
    traces = {p.name: p.read_bytes() for p in Path(root, "profile").iterdir()}
    resumed = train(
        tiny_job(Path(corpus), *asynchronous, "training.steps=6"), resume=True, log=False
    )
    traces_kept = {p.name: p.read_bytes() for p in Path(root, "profile").iterdir()} == traces
    if full is None or first is None or resumed is None:
        return None
    return {
        "full": full,
        "first": first,
        "resumed": resumed,
        "committed_after_first": committed,
        "traces_after_first": sorted(traces),
        "traces_kept_by_resume": traces_kept,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("interrupted")
    corpus = write_corpus(root / "corpus")
    out: dict[str, Any] = {"root": root}
    out["ctrl_c_status"] = _ctrl_c_after_a_step(_launch(root, corpus, "ctrl_c"), root)
    out["ctrl_c_steps"] = [r["step"] for r in _logged_steps(root)]
    out["ctrl_c_checkpoints"] = sorted(p.name for p in (root / "ckpt").iterdir())
    out["ctrl_c_stderr"] = (root / "ctrl_c.err").read_text()
    stopped = latest_step(root / "ckpt") or 0
    # resumed, with this process as the launcher (saves starting another interpreter)
    done = threading.Event()
    sender = threading.Thread(target=_sigterm_to_this_process_after, args=(stopped, root, done))
    stderr = io.StringIO()
    # a SIGTERM arriving after main() returned (it failed early) must not end pytest
    default = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    sender.start()
    try:
        with contextlib.redirect_stderr(stderr):
            out["sigterm_status"] = main([*_command_line(root, corpus), "--resume"])
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGTERM, default)
    out["sigterm_records"] = _logged_steps(root)
    out["sigterm_checkpoints"] = sorted(p.name for p in (root / "ckpt").iterdir())
    out["sigterm_stderr"] = stderr.getvalue()
    last = latest_step(root / "ckpt") or 0
    out["in_process"] = run_on_ranks(
        _in_process, 2, str(corpus), str(root), max(last, 6), timeout_s=240
    )[0]
    return out


def test_ctrl_c_saves_the_current_step_once_and_exits_130(runs: dict[str, Any]) -> None:
    assert runs["ctrl_c_status"] == 130, runs["ctrl_c_stderr"]
    steps = runs["ctrl_c_steps"]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1))
    # one checkpoint: the step the ranks stopped after, committed (DCP metadata written)
    assert runs["ctrl_c_checkpoints"] == [f"step-{stopped}"]
    assert (runs["root"] / "ckpt" / f"step-{stopped}" / ".metadata").is_file()
    assert f"stopped by a signal after step {stopped}: checkpoint" in runs["ctrl_c_stderr"]
    assert "FAILED" not in runs["ctrl_c_stderr"] and "Traceback" not in runs["ctrl_c_stderr"]
    # rank 0 printed how long each startup phase took, in one line
    phases = r"imports [\d.]+ s, mesh [\d.]+ s, build [\d.]+ s, parallelize [\d.]+ s, data [\d.]+ s"
    assert re.search(rf"\[hp-train\] startup: {phases} \(total [\d.]+ s\)", runs["ctrl_c_stderr"])


def test_sigterm_to_the_launcher_alone_saves_and_the_resumed_losses_are_uninterrupted(
    runs: dict[str, Any],
) -> None:
    assert runs["sigterm_status"] == 130, runs["sigterm_stderr"]
    first_stop = int(runs["ctrl_c_checkpoints"][0].split("-")[1])
    records = runs["sigterm_records"]
    second_stop = records[-1]["step"]
    assert second_stop > first_stop
    assert [r["step"] for r in records] == list(range(1, second_stop + 1))
    assert runs["sigterm_checkpoints"] == sorted([f"step-{first_stop}", f"step-{second_stop}"])
    assert "Traceback" not in runs["sigterm_stderr"]
    # both stops, their checkpoints and the resume: the losses of one uninterrupted run
    full: RunSummary = runs["in_process"]["full"]
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]),
        torch.tensor(full.losses[:second_stop]),
        rtol=1e-5,
        atol=0,
    )


def test_async_checkpoints_resume_to_the_uninterrupted_losses(runs: dict[str, Any]) -> None:
    got = runs["in_process"]
    full, first, resumed = got["full"], got["first"], got["resumed"]
    # every asynchronous save was committed by the end of the run
    assert got["committed_after_first"] == ["step-2", "step-4"]
    assert resumed.first_step == 5
    # a resumed run times its checkpoint load among the startup phases
    assert list(resumed.startup_seconds) == ["mesh", "build", "parallelize", "data", "checkpoint"]
    assert "checkpoint" not in first.startup_seconds
    torch.testing.assert_close(
        torch.tensor(first.losses + resumed.losses),
        torch.tensor(full.losses[:6]),
        rtol=1e-5,
        atol=0,
    )


def test_the_profiler_traces_the_configured_steps_on_every_rank(runs: dict[str, Any]) -> None:
    assert runs["in_process"]["traces_after_first"] == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        trace = json.loads((runs["root"] / "profile" / f"rank{rank}.json").read_text())
        steps = sorted(
            {
                e["name"]
                for e in trace["traceEvents"]
                if e.get("name", "").startswith("ProfilerStep#")
            }
        )
        # torch numbers the profiler's steps from 0 at the run's first: steps 2 and 3
        assert steps == ["ProfilerStep#1", "ProfilerStep#2"], (rank, steps)
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names, rank  # the model's matmuls
    # resumed at step 5, the run is past the range: the traces of steps 2-3 stay
    assert runs["in_process"]["traces_kept_by_resume"]

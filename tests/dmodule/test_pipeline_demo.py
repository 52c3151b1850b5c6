"""The demo's ``--pp N --schedule NAME --microbatches M``: parity with one process, per-rank bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.dmodule.test_demo import TINY, _demo

from hyper_parallel.dmodule.demo import parse_args


def test_demo_pipelined_two_ranks_passes_parity_and_splits_the_parameters(tmp_path: Path) -> None:
    pipelined = ["--pp", "2", "--tp", "1", "--schedule", "GPipe", "--microbatches", "2"]
    plot = str(tmp_path / "curve.png")
    done = _demo(
        [*pipelined, "--steps", "2", "--seq-len", "8", "--plot", plot, *TINY, "--model.n_layers=2"]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "pp=2 (GPipe)" in out and "PASS" in out
    assert "parameter bytes per rank (pp=2, GPipe, 2 microbatches" in out
    shares = [
        float(line.split("(")[1].split()[0]) for line in out.splitlines() if "  rank " in line
    ]
    assert len(shares) == 2 and abs(sum(shares) - 1) < 1e-6  # each rank holds its own stage
    assert all(0.3 < share < 0.7 for share in shares), shares


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--pp", "2", "--microbatches", "3"],
            "--batch-size 8 / --dp 1 must divide by --microbatches 3",
        ),
        (
            ["--pp", "2", "--schedule", "ZBVZeroBubble"],
            "needs 4 stages, more than --model.n_layers 2",
        ),
        (
            ["--pp", "2", "--dp-shard", "2", "--microbatches", "3"],
            "--batch-size 8 / --dp-shard 2 must divide by --microbatches 3",
        ),
        (
            ["--pp", "2", "--dp-shard", "2", "--dp-replicate", "2"],
            "--dp-replicate does not compose with --pp yet",
        ),
        (["--pp", "2", "--checkpoint-dir", "c"], "do not support --pp yet"),
        (["--pp", "0"], "--pp must be >= 1"),
        (["--pp", "2", "--schedule", "OneFOneB"], "invalid choice: 'OneFOneB'"),
    ],
)
def test_demo_refuses_pipeline_options_before_starting_ranks(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_pipeline_composes_with_dp_shard() -> None:
    options = parse_args(["--pp", "2", "--dp-shard", "2", "--tp", "1"])
    assert (options.pp, options.dp_shard, options.world) == (2, 2, 4)


def test_demo_pipeline_options_default_to_one_microbatch_per_stage() -> None:
    options = parse_args(["--pp", "2", "--model.n_layers=4"])
    assert (options.pp, options.schedule, options.microbatches) == (2, "1F1B", 2)
    assert parse_args([]).pp == 1

"""``--dry-run``: every rank's bytes from the job alone (fake process group), and its refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.train._jobs import tiny_job, write_corpus

from hyper_parallel.train.cli import main
from hyper_parallel.train.trainer import build_model_config


def test_dry_run_gives_each_ranks_fully_sharded_bytes_and_refuses_over_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyper_parallel.train.dry_run import check_memory, dry_run

    job = tiny_job(write_corpus(tmp_path), "parallelism.dp_shard=2")
    ranks, counts = dry_run(job)
    # the oracle: each parameter of the one-process model split along dim 0 as torch.chunk does
    with torch.device("meta"):
        full = build_model_config(job, 257).build()
    for rank in (0, 1):
        want = sum(
            torch.chunk(p, 2)[rank].numel() * 4 if len(torch.chunk(p, 2)) > rank else 0
            for p in full.parameters()
        )
        assert ranks[rank].params == want
        assert ranks[rank].optimizer == 2 * want  # AdamW's two moments
    assert counts is not None and counts["reduce_scatter"] > 0  # FSDP's gradient reduction
    with pytest.raises(ValueError, match=r"rank \d needs .* over --dry-run-memory 1e-05 GiB"):
        check_memory(ranks, 1e-5)
    # the command: the table on stdout, status 2 over the limit, no process started
    # dp_shard = -1 with --world-size: the rest of the world, planned as the explicit 2
    argv = ["--parallelism.dp_shard=-1", "--world-size=2", f"--data.path={tmp_path}", "--dry-run"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "on 2 ranks (dp_replicate=1 dp_shard=2 tp=1 pp=1)" in table
    assert "collectives per step (rank 0)" in table
    assert main([f"--data.path={tmp_path}", "--dry-run", "--dry-run-memory", "0.00001"]) == 2
    assert "largest tensors: " in capsys.readouterr().err

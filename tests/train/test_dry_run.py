"""``--dry-run``: each role's bytes from the job alone (fake tensors, fake process group)."""

from __future__ import annotations

import json
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
    report = dry_run(job, 2)
    # the oracle: each parameter of the one-process model split along dim 0 as torch.chunk does
    with torch.device("meta"):
        full = build_model_config(job, 257).build()
    by_rank = {r: role for role in report.roles for r in role.ranks}
    assert sorted(by_rank) == [0, 1]
    for rank in (0, 1):
        want = sum(
            torch.chunk(p, 2)[rank].numel() * 4 if len(torch.chunk(p, 2)) > rank else 0
            for p in full.parameters()
        )
        assert by_rank[rank].params_bytes == want
        tensors = len(list(full.parameters()))
        assert by_rank[rank].optimizer_bytes == 2 * want + 4 * tensors  # moments and steps
    with pytest.raises(ValueError, match=r"stage 0 \(ranks 0\) needs .* over --dry-run-memory"):
        check_memory(report, 1e-5)
    # the command: the table on stdout, status 2 over the limit, no process started
    # dp_shard = -1 with --world-size: the rest of the world, planned as the explicit 2
    argv = ["--parallelism.dp_shard=-1", "--world-size=2", f"--data.path={tmp_path}", "--dry-run"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "on 2 ranks (dp_replicate=1 dp_shard=2 cp=1 tp=1 pp=1" in table
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    assert main([f"--data.path={tmp_path}", "--dry-run", "--dry-run-memory", "0.00001"]) == 2
    refusal = capsys.readouterr().err
    assert "stage 0 (ranks 0) needs" in refusal and "over --dry-run-memory 1e-05 GiB" in refusal
    assert "largest tensors: " in refusal

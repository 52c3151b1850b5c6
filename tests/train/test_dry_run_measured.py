"""``--dry-run`` against real runs: activations within 10% of the saved tensors a real 2-rank
forward keeps (TP, FSDP, CP, EP, activation checkpointing), parameter bytes summing to the model."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import tiny_job, write_corpus

from hyper_parallel.dmodule import get_spec
from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.train.config import JobConfig, batch_layout
from hyper_parallel.train.dry_run import DryRunCache, dry_run
from hyper_parallel.train.saved_tensors import count_activations, fake_world
from hyper_parallel.train.trainer import build_model_config, model_job_config, parallel_dims

#: three blocks: the dry run measures one and multiplies, the real run runs all three
_LLAMA = [
    'model.config={"dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, '
    '"max_seq_len": 32}',
    "training.seq_len=32",
    "training.global_batch_size=4",
]
_MOE = [
    "model.name=qwen3-ref",
    "model.flavor=debug-moe",
    'model.config={"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, '
    '"moe_ffn_dim": 32, "num_experts": 4, "top_k": 2, "max_seq_len": 32}',
    "training.seq_len=32",
    "training.global_batch_size=4",
]
#: name -> overrides; every layout on 2 ranks
CASES: dict[str, list[str]] = {
    "tp": [*_LLAMA, "parallelism.tp=2"],
    "fsdp": [*_LLAMA, "parallelism.dp_shard=2"],
    "fsdp_full_ac": [*_LLAMA, "parallelism.dp_shard=2", "parallelism.activation_checkpoint=full"],
    "cp": [*_LLAMA, "parallelism.cp=2"],
    "ep": [*_MOE, "parallelism.dp_shard=2", "parallelism.ep=2"],
}


def _job(corpus: str, overrides: list[str]) -> JobConfig:
    return tiny_job(Path(corpus), *overrides)


def _real_saved_bytes(corpus: str) -> dict[str, int]:
    """Per case: what this rank's real forward and loss save (the dry run's own counting rule)."""
    world = torch.distributed.get_world_size()
    saved: dict[str, int] = {}
    for name, overrides in CASES.items():
        job = _job(corpus, overrides)
        dims = parallel_dims(job, world)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = build_model_config(job, 257).build()
        spec = get_spec(job.model.name)
        assert spec.parallelize_fn is not None
        model = spec.parallelize_fn(model, dims, model_job_config(job))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()  # type: ignore[operator]
        local_batch, _ = batch_layout(job)
        # the same tokens on every rank (context parallelism needs them; others do not mind)
        tokens = torch.randint(
            0, 257, (local_batch, job.training.seq_len), generator=torch.Generator().manual_seed(1)
        )
        blocks = [(f"layers.{i}", "block", b) for i, b in enumerate(model.layers)]  # type: ignore[arg-type]
        loss = model.loss  # type: ignore[operator]
        targets = tokens.roll(-1, dims=1)  # its own storage, as a run's
        counted = count_activations(model, blocks, functools.partial(loss, tokens, targets))
        saved[name] = counted.total
    return saved


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_corpus(tmp_path_factory.mktemp("corpus")))


def test_dry_run_activations_are_within_10_percent_of_a_real_2_rank_forward(corpus: str) -> None:
    real = run_on_ranks(_real_saved_bytes, 2, corpus, timeout_s=240.0)
    cache = DryRunCache()
    for name, overrides in CASES.items():
        report = dry_run(_job(corpus, overrides), 2, cache=cache)
        by_rank = {r: role for role in report.roles for r in role.ranks}
        for rank in (0, 1):
            want, got = real[rank][name], by_rank[rank].activations_bytes
            assert abs(got - want) <= 0.1 * want, (name, rank, got, want)


def test_parameter_bytes_sum_to_the_model_plus_tp_copies_of_the_norms(corpus: str) -> None:
    # tp 2 x pp 2 x dp_shard 2 over 3 blocks (uneven stages) and a vocabulary of 257 (uneven shards)
    job = _job(corpus, [*_LLAMA, "parallelism.tp=2", "parallelism.pp=2", "parallelism.dp_shard=2"])
    report = dry_run(job, 8)
    ranks = sorted(r for role in report.roles for r in role.ranks)
    assert ranks == list(range(8))  # every rank in exactly one role
    with torch.device("meta"):
        model = build_model_config(job, 257).build()
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    held = sum(role.params_bytes * len(role.ranks) for role in report.roles)
    assert held == total + (2 - 1) * norms
    assert len(report.roles) > 2  # the stages, and uneven shards within them


def _stage_saved_bytes(job: JobConfig, rank: int, world: int) -> int:
    """What ``rank``'s real pipeline stage saves in one microbatch's forward (and loss on the
    last), on fake tensors and the fake process group: the stage module the run builds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = parallel_dims(job, world)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = build_model_config(job, 257).build()
        spec = get_spec(job.model.name)
        assert spec.pipelining_fn is not None
        pipe = spec.pipelining_fn(model, dims, model_job_config(job))
        (part,) = pipe.model_parts
        (stage,) = pipe.stages
        local_batch, _ = batch_layout(job)
        microbatch = local_batch // job.parallelism.pipeline_microbatches
        seq = job.training.seq_len
        with fake_world():
            part.to_empty(device="cpu")
            with torch.no_grad():
                for t in [*part.parameters(), *part.buffers()]:
                    t.zero_()
            tokens = torch.zeros(microbatch, seq, dtype=torch.long)
            targets = torch.zeros(microbatch, seq, dtype=torch.long)
            if pipe.has_first_stage:
                given = tokens
            else:  # what the previous stage sends: the residual stream, a plain local tensor
                given = torch.empty(microbatch, seq, 32, requires_grad=True)
            blocks = [(f"layers.{i}", "block", b) for i, b in enumerate(part.layers)]  # type: ignore[arg-type]

            def run() -> None:
                out = stage.submod(given)
                if pipe.has_last_stage:
                    stage.submod.loss(cross_entropy, out, targets, {})  # type: ignore[operator]

            return count_activations(part, blocks, run).total
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("checkpointing", ["full"])
def test_pipeline_stages_activations_equal_the_stage_modules_own(
    corpus: str, checkpointing: str
) -> None:
    # pp 2 x tp 2 over 3 blocks: stage 0 holds the embedding and 2 blocks, stage 1 a block and
    # the head; the dry run composes them from one block measured without a pipeline
    job = _job(
        corpus,
        [
            *_LLAMA,
            "parallelism.tp=2",
            "parallelism.pp=2",
            "parallelism.pipeline_microbatches=2",
            f"parallelism.activation_checkpoint={checkpointing}",
        ],
    )
    report = dry_run(job, 4)
    by_rank = {r: role for role in report.roles for r in role.ranks}
    for rank in (0, 2):  # tp rank 0 of each stage
        assert by_rank[rank].activations_bytes == _stage_saved_bytes(job, rank, 4), rank

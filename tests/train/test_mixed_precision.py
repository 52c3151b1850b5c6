"""hp-train's bfloat16 under FSDP: TorchTitan's MixedPrecisionPolicy through the models' fully_shard."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import initial_model, tiny_job, write_corpus

from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3
from hyper_parallel.dmodule.models.qwen3_sharding import parallelize_qwen3
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dtensor.fsdp import MixedPrecisionPolicy
from hyper_parallel.train.config import JobConfig, batch_layout
from hyper_parallel.train.data import BatchSampler
from hyper_parallel.train.lr import lr_at
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import load_samples, train

STEPS = 3
#: no weight decay: the oracle's one AdamW group is the trainer's two
MIXED = [
    "parallelism.dp_shard=2",
    "training.param_dtype=bfloat16",
    f"training.steps={STEPS}",
    "optimizer.weight_decay=0",
    "optimizer.lr=0.1",
]


def _train_mixed(corpus: str) -> list[float] | None:
    torch.set_num_threads(1)
    summary = train(tiny_job(Path(corpus), *MIXED), log=False)
    return None if summary is None else summary.losses


def _one_process_losses(job: JobConfig, compute_dtype: torch.dtype) -> list[float]:
    """FSDP's mixed precision by hand: each data-parallel rank's batch through a
    ``compute_dtype`` copy of the float32 weights, the copies' gradients averaged in
    float32 into the weights, clipped, and AdamW on the float32 weights."""
    model = initial_model(job, Llama)
    train_samples, _ = load_samples(job, ByteTokenizer())
    local, accumulation = batch_layout(job)
    samplers = [
        BatchSampler(
            train_samples,
            seed=job.training.seed,
            dp_rank=rank,
            dp=2,
            local_batch=local,
            accumulation=accumulation,
        )
        for rank in range(2)
    ]
    opt = job.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=0.0
    )
    losses = []
    for step in range(1, STEPS + 1):
        rank_losses = []
        grads: list[torch.Tensor] = [torch.zeros_like(p) for p in model.parameters()]
        for sampler in samplers:
            (batch,) = sampler.next_step()
            compute = copy.deepcopy(model).to(compute_dtype)
            loss = compute.loss(batch.tokens, batch.targets, document_ids=batch.document_ids)
            loss.backward()  # type: ignore[no-untyped-call]
            rank_losses.append(float(loss.detach()))
            for total, p in zip(grads, compute.parameters(), strict=True):
                assert p.grad is not None
                total += p.grad.float()
        for p, total in zip(model.parameters(), grads, strict=True):
            p.grad = total / 2
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), job.training.max_norm)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt.lr, job.lr_scheduler)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(rank_losses) / 2)
    return losses


def test_bfloat16_with_fsdp_matches_bfloat16_copies_of_float32_weights(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    (losses, _) = run_on_ranks(_train_mixed, 2, str(corpus), timeout_s=240)
    assert losses is not None and len(losses) == STEPS
    job = tiny_job(corpus, *MIXED)
    mixed = torch.tensor(_one_process_losses(job, torch.bfloat16))
    full = torch.tensor(_one_process_losses(job, torch.float32))
    got = torch.tensor(losses)
    torch.testing.assert_close(got, mixed, rtol=2e-6, atol=0)
    # and not float32's: the tolerance above tells the two apart at every step
    assert ((got - full).abs() > 2e-6 * full.abs()).all(), (got, full)


def test_experts_outside_fsdp_refuse_a_lower_param_dtype_before_any_change() -> None:
    config = Qwen3.Config(
        dim=16, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=8, num_experts=4, moe_ffn_dim=16
    )
    with torch.device("meta"):
        model = config.build()
    before = {name: type(p) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mp_policy.*ep = 1, efsdp = 2"):
        parallelize_qwen3(model, ParallelDims(dp_shard=2, world_size=2), {"mp_policy": policy})
    assert {name: type(p) for name, p in model.named_parameters()} == before
    with pytest.raises(TypeError, match="expected a MixedPrecisionPolicy, found str"):
        parallelize_qwen3(model, ParallelDims(dp_shard=2, world_size=2), {"mp_policy": "bf16"})


#: a pipeline of 2 stages, each fully sharded over dp_shard=2 with the policy, blocks
#: checkpointed: the job_config reaches every stage's parallelize_fn
PIPELINE = ["parallelism.pp=2", "model.config.n_layers=2", "parallelism.activation_checkpoint=full"]


def _train_mixed_pipeline(corpus: str) -> list[float] | None:
    torch.set_num_threads(1)
    summary = train(tiny_job(Path(corpus), *MIXED, *PIPELINE), log=False)
    return None if summary is None else summary.losses


def test_bfloat16_pipeline_stages_get_the_policy(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    losses = run_on_ranks(_train_mixed_pipeline, 4, str(corpus), timeout_s=300)[0]
    assert losses is not None and len(losses) == STEPS
    job = tiny_job(corpus, *MIXED, *PIPELINE)
    mixed = _one_process_losses(job, torch.bfloat16)
    full = _one_process_losses(job, torch.float32)
    # step 1, the same weights: the bfloat16 copies' loss, not float32's
    assert losses[0] == pytest.approx(mixed[0], rel=1e-6)
    assert losses[0] != pytest.approx(full[0], rel=1e-6)
    # later steps: microbatches accumulate bfloat16 gradients in another order than the
    # oracle's one backward, still much nearer the bfloat16 run than float32's
    for step in range(1, STEPS):
        assert abs(losses[step] - mixed[step]) < 0.2 * abs(full[step] - mixed[step]), step

"""hp-train's overhead: its step time against a bare loop on the same model and layout; data rate.

Run: uv run python bench/bench_trainer.py [--tp 2] [--dim 128] [--layers 2] [--steps 30] [--rounds 3]

(1) Step time. In the same rank processes, rounds alternate: ``hp-train``'s ``train()``
for ``--steps`` steps (its data pipeline, LR schedule, the shared ``train_step``: forward,
backward, ``clip_grad_norm_``, AdamW, the loss averaged and read back, the metrics'
bookkeeping; no files written), then a bare loop a user would write on the same
parallelized llama-ref: a fixed batch, ``model.loss``, ``backward``, ``clip_grad_norm_``,
``optimizer.step``, ``zero_grad``. Each side's figure is the median step of the slowest
rank in each round, the first 3 steps left out (warm-up), and the least disturbed round
(the minimum over rounds: load from other processes only adds time). Reported:
trainer / bare (goal: <= 1.02).

(2) Data. One process packs the built-in corpus and times ``BatchSampler.next_step`` for
a global batch alone: tokens/s the pipeline produces, against the tokens/s training
consumes in (1). Reported: produced / consumed (goal: >= 20).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.models.llama import parallelize_llama
from hyper_parallel.dtensor import FallbackWarning, clip_grad_norm_
from hyper_parallel.platform_torch.launch import run_distributed
from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.data import BatchSampler, pack, read_documents
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import build_model_config, train

WARMUP = 3


def _job(tp: int, dim: int, layers: int, steps: int) -> JobConfig:
    return JobConfig().apply_overrides(
        [
            f'model.config={{"dim": {dim}, "n_layers": {layers}, "n_heads": 4, "n_kv_heads": 2, '
            f'"ffn_dim": {4 * dim}, "max_seq_len": 64}}',
            f"parallelism.tp={tp}",
            f"training.steps={steps}",
            "training.seq_len=64",
            "training.global_batch_size=8",
            "data.holdout=0",
        ]
    )


def _bare(job: JobConfig, world: int) -> list[float]:
    """The same model, layout and batch shape, trained by the loop a user would write."""
    dims = ParallelDims(tp=job.parallelism.tp, world_size=world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = build_model_config(job, 257).build()
    parallelize_llama(model, dims)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, 257, (8, 65), generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(job.training.steps):
        start = time.perf_counter()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # type: ignore[no-untyped-call]
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return seconds


def _rounds(job: JobConfig, rounds: int) -> dict[str, list[list[float]]]:
    world = torch.distributed.get_world_size()
    out: dict[str, list[list[float]]] = {"trainer": [], "bare": []}
    for _ in range(rounds):
        summary = train(job, log=False)
        mine = torch.tensor(summary.seconds if summary is not None else [0.0] * job.training.steps)
        out["trainer"].append(mine.tolist())
        out["bare"].append(_bare(job, world))
    return out


def _slowest_medians(per_rank: list[dict[str, list[list[float]]]], side: str) -> list[float]:
    """Each round's median step of the slowest rank (warm-up steps left out)."""
    medians = []
    for round_index in range(len(per_rank[0][side])):
        columns = zip(*(r[side][round_index] for r in per_rank), strict=True)
        medians.append(float(statistics.median(max(c) for c in list(columns)[WARMUP:])))
    return medians


def _data_rate(seconds_budget: float = 3.0) -> float:
    """Tokens/s ``BatchSampler.next_step`` delivers for a global batch of 8 x 64 (one process)."""
    samples = pack(read_documents(""), ByteTokenizer(), seq_len=64)
    sampler = BatchSampler(samples, seed=0, dp_rank=0, dp=1, local_batch=8, accumulation=1)
    produced, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds_budget:
        for batch in sampler.next_step():
            produced += batch.tokens.numel()
    return produced / (time.perf_counter() - start)


def main() -> None:
    """Print the trainer's overhead and the data pipeline's headroom."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    job = _job(args.tp, args.dim, args.layers, args.steps)
    per_rank = run_distributed(_rounds, args.tp, args=(job, args.rounds), timeout_s=1200)
    # the least disturbed round of each side: on a loaded machine other processes only add time
    trainer = min(_slowest_medians(per_rank, "trainer"))
    bare = min(_slowest_medians(per_rank, "bare"))
    print(
        f"step time, tp={args.tp} dim={args.dim} layers={args.layers}, batch 8 x 64 "
        f"(min over {args.rounds} interleaved rounds of each round's median step): "
        f"trainer {trainer * 1e3:.1f} ms, bare loop {bare * 1e3:.1f} ms, "
        f"trainer / bare = {trainer / bare:.3f} (goal <= 1.02)"
    )
    consumed = 8 * 64 / trainer
    produced = _data_rate()
    print(
        f"data: the pipeline produces {produced:,.0f} tokens/s, training consumes "
        f"{consumed:,.0f} tokens/s: {produced / consumed:.1f}x (goal >= 20x)"
    )


if __name__ == "__main__":
    main()

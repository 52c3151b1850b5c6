"""Pipeline parallelism on 4 ranks: step time against no pipeline, measured bubble, peak memory.

Run: uv run python bench/bench_pipeline.py [--layers 8] [--dim 256] [--reps 3] [--quick]

The bench Llama (``bench_init_memory.config`` with ``--dim``/``--layers``) on 4 CPU
ranks (gloo), global batch ``--batch`` x ``--seq`` tokens, AdamW. Layouts, each against
the same ranks used without a pipeline (the ``pp`` axis turned into data parallelism):

- ``pp=2 x dp=2`` against ``dp=4``;
- ``pp=2 x tp=2`` against ``dp=2 x tp=2``;

for GPipe, 1F1B and Interleaved1F1B (2 stages per rank) at 4 and 8 microbatches. Every
configuration runs in fresh rank processes (so peak memory is its own).

Reported per configuration:
- ``step``: one training step (pipeline or forward/backward, dp gradient average, AdamW),
  the slowest rank, minimum over ``--reps`` steps after a warm-up, and its ratio to the
  layout's no-pipeline baseline run in the same invocation;
- ``bubble``: ``1 - busy / pipe``, where ``pipe`` is the time of ``Pipeline.step`` and
  ``busy`` the rank's time inside torch's ``PipelineStage`` forward/backward calls (and
  the schedule's loss computation), the
  mean over ranks (minimum-``pipe`` step); ``theory``: ``(p - 1) / (v * m + p - 1)`` for
  ``p`` ranks, ``v`` stages per rank, ``m`` microbatches (GPipe and 1F1B: ``v = 1``);
- ``peak``: peak RSS per rank above the baseline taken after the mesh exists
  (``VmHWM`` reset through ``/proc/self/clear_refs``), the max over ranks.

With more processes than cores, a rank waiting in a bubble lends its core to another
rank, so the measured bubble depends on the machine; quote ``uptime`` with it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from bench.bench_init_memory import _peak_rss_bytes, _reset_peak, config

from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.training import average_gradients, synthetic_batch
from hyper_parallel.dmodule.pipeline import pipeline
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.platform_torch.launch import run_distributed

WORLD = 4
LAYOUTS = {"pp=2 x dp=2": (2, 2, 1), "pp=2 x tp=2": (2, 1, 2)}  # (pp, dp, tp)
SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2))


def _model_config(args: argparse.Namespace) -> Llama.Config:
    return config(args.layers).replace(dim=args.dim, ffn_dim=args.dim * 3, max_seq_len=args.seq)


def _timed(fn: Callable[..., Any], busy: list[float]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            busy[0] += time.perf_counter() - start

    return run


def _rank(
    args: argparse.Namespace, layout: tuple[int, int, int], schedule: str | None, m: int, v: int
) -> dict[str, Any]:
    """One rank of one configuration (``schedule=None``: the no-pipeline baseline)."""
    pp, dp, tp = layout
    cfg = _model_config(args)
    if schedule is None:
        mesh = init_device_mesh("cpu", (pp * dp, tp), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dist.barrier()
    _reset_peak()
    base = _peak_rss_bytes()
    busy = [0.0]
    with torch.device("meta"):
        model = cfg.build()
    if schedule is None:
        model.parallelize(mesh["tp"]).to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        parts: list[torch.nn.Module] = [model]
    else:
        pipe = pipeline(
            model,
            mesh,
            schedule=schedule,
            n_microbatches=m,
            loss_fn=cross_entropy,
            stages_per_rank=v,
        )
        torch.manual_seed(0)
        pipe.init_weights()
        parts = pipe.model_parts
        for stage in pipe.stages:  # instance attributes: this bench's stages only
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, _timed(getattr(stage, name), busy))
        # the last stage's loss runs in the schedule, between the stage's calls
        pipe.schedule._compute_loss = _timed(pipe.schedule._compute_loss, busy)  # type: ignore[method-assign]
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-4)
    dp_size = mesh.size("dp")
    dp_rank = mesh.get_local_rank("dp")
    rows = args.batch // dp_size
    steps, pipes, busies = [], [], []
    for step in range(args.reps + 1):
        tokens, targets = synthetic_batch(
            step, batch_size=args.batch, seq_len=args.seq, vocab_size=cfg.vocab_size
        )
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        tokens, targets = tokens[mine], targets[mine]
        dist.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        if schedule is None:
            model.loss(tokens, targets).backward()
            pipe_s = time.perf_counter() - start
        else:
            pipe.step(tokens, target=targets)
            pipe_s = time.perf_counter() - start
        for part in parts:
            average_gradients(part, mesh, "dp")
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first step is a warm-up
            steps.append(time.perf_counter() - start)
            pipes.append(pipe_s)
            busies.append(busy[0])
    best = min(range(len(pipes)), key=pipes.__getitem__)
    return {
        "step": steps,
        "pipe": pipes[best],
        "busy": busies[best],
        "peak": _peak_rss_bytes() - base,
    }


def _run(
    args: argparse.Namespace, layout: tuple[int, int, int], schedule: str | None, m: int, v: int
) -> dict[str, float]:
    ranks = run_distributed(_rank, WORLD, args=(args, layout, schedule, m, v), timeout_s=1800)
    # the slowest rank of each step, then the least disturbed step
    step = min(max(r["step"][i] for r in ranks) for i in range(args.reps))
    bubbles = [1 - r["busy"] / r["pipe"] for r in ranks]
    return {
        "step": step,
        "bubble": sum(bubbles) / len(bubbles),
        "peak": max(r["peak"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed steps after a warm-up")
    parser.add_argument("--quick", action="store_true", help="1F1B at 4 microbatches only")
    args = parser.parse_args()
    schedules = (("1F1B", 1),) if args.quick else SCHEDULES
    counts = (4,) if args.quick else (4, 8)
    cfg = _model_config(args)
    n_params = cfg.get_nparams_and_flops(cfg.build(), args.seq)[0]
    print(
        f"bench Llama: {args.layers} layers, dim {args.dim}, {n_params / 1e6:.1f} M parameters; "
        f"batch {args.batch} x {args.seq} tokens; {WORLD} CPU ranks (gloo)"
    )
    header = f"{'layout':<14}{'schedule':<17}{'m':>3}{'step s':>9}{'/ no-PP':>9}"
    header += f"{'bubble':>9}{'theory':>9}{'peak MiB':>10}"
    for name, layout in LAYOUTS.items():
        pp, dp, tp = layout
        baseline = _run(args, layout, None, 1, 1)
        label = f"dp={pp * dp}" + (f" x tp={tp}" if tp > 1 else "")
        print(f"\n{name} against {label} (no pipeline)\n{header}")
        print(
            f"{label:<14}{'-':<17}{'-':>3}{baseline['step']:9.3f}{1.0:9.2f}{'':>9}{'':>9}"
            f"{baseline['peak'] / 2**20:10.1f}"
        )
        for schedule, v in schedules:
            for m in counts:
                got = _run(args, layout, schedule, m, v)
                theory = (pp - 1) / (v * m + pp - 1)
                print(
                    f"{name:<14}{schedule:<17}{m:>3}{got['step']:9.3f}"
                    f"{got['step'] / baseline['step']:9.2f}{got['bubble']:9.3f}{theory:9.3f}"
                    f"{got['peak'] / 2**20:10.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""``hp-train --dry-run`` at published sizes: llama-ref's Llama 3.1 405B / 70B / 8B flavors.

Each case runs the command a user types (a fresh ``hp-train`` process, imports included)
and reports its wall time and the busiest role's total; ``--in-process`` also times
``dry_run()`` alone in this process, cold and then again through a ``DryRunCache`` with
another ``dp_shard x pp`` split (what the planner does per candidate).

    uv run python bench/bench_dry_run.py                 # all three
    uv run python bench/bench_dry_run.py --only 405B --in-process
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

COMMON = ["--training.seq_len=8192", "--training.param_dtype=bfloat16"]
CASES: dict[str, tuple[int, list[str]]] = {
    # TorchTitan's 8B recipe: FSDP over 8 ranks, selective checkpointing, local batch 1
    "8B": (
        8,
        [
            "--parallelism.dp_shard=8",
            "--training.global_batch_size=8",
            "--parallelism.activation_checkpoint=selective",
        ],
    ),
    # tp 8 x pp 4 x dp_shard 16; 4 microbatches of 1 sample per step
    "70B": (
        512,
        [
            "--parallelism.tp=8",
            "--parallelism.pp=4",
            "--parallelism.dp_shard=16",
            "--training.global_batch_size=64",
            "--training.local_batch_size=4",
            "--parallelism.pipeline_microbatches=4",
            "--parallelism.activation_checkpoint=full",
        ],
    ),
    # issue 33's goal: tp 8 x pp 16 x dp_shard 16, global batch 256, microbatches of 1
    "405B": (
        2048,
        [
            "--parallelism.tp=8",
            "--parallelism.pp=16",
            "--parallelism.dp_shard=16",
            "--training.global_batch_size=256",
            "--training.local_batch_size=16",
            "--parallelism.pipeline_microbatches=16",
            "--parallelism.activation_checkpoint=full",
        ],
    ),
}


def argv_of(name: str) -> list[str]:
    """The ``hp-train`` arguments of a case (without ``--dry-run``)."""
    world, extra = CASES[name]
    return [f"--model.flavor={name}", *COMMON, *extra, f"--world-size={world}"]


def run_command(name: str, pycache: str = "") -> tuple[float, float, dict[str, object]]:
    """A fresh ``hp-train --dry-run --json`` process: wall and CPU seconds, and its report.

    The CPU seconds (user + system of the process) do not grow with other processes' load
    on the machine; the wall seconds do.
    """
    command = [sys.executable, "-m", "hyper_parallel.train", *argv_of(name), "--dry-run", "--json"]
    env = dict(os.environ)
    if pycache:  # bytecode cached there (a sandbox may set PYTHONDONTWRITEBYTECODE)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def run_in_process(name: str) -> tuple[float, float]:
    """``dry_run()`` cold, then another dp_shard x pp split of the same world through the cache."""
    from hyper_parallel.config import parse_cli_overrides
    from hyper_parallel.train.config import JobConfig
    from hyper_parallel.train.dry_run import DryRunCache, dry_run

    world, _ = CASES[name]
    overrides, _ = parse_cli_overrides(argv_of(name)[:-1], JobConfig)
    job = JobConfig().apply_overrides(overrides)
    cache = DryRunCache()
    start = time.perf_counter()
    dry_run(job, world, cache=cache)
    cold = time.perf_counter() - start
    par = job.parallelism
    if par.pp > 1:  # half the stages, twice the FSDP shards; same microbatch
        other = job.apply_overrides(
            [
                f"parallelism.pp={par.pp // 2}",
                f"parallelism.dp_shard={par.dp_shard * 2}",
                f"training.local_batch_size={(job.training.local_batch_size or 1) // 2}",
                f"parallelism.pipeline_microbatches={par.pipeline_microbatches // 2}",
            ]
        )
    else:
        other = job.apply_overrides(["parallelism.activation_checkpoint=full"])
    start = time.perf_counter()
    dry_run(other, world, cache=cache)
    return cold, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--in-process", action="store_true", help="also time dry_run() itself")
    parser.add_argument(
        "--pycache",
        default="",
        metavar="DIR",
        help="cache bytecode in DIR (one untimed warm-up run first): a start without "
        "compiling torch's sources, as outside a PYTHONDONTWRITEBYTECODE sandbox",
    )
    args = parser.parse_args()
    print(
        f"{'case':>5}  {'ranks':>5}  {'roles':>5}  {'busiest GiB':>11}  {'wall s':>7}  {'CPU s':>6}"
    )
    for name in args.only:
        if args.pycache:
            run_command(name, args.pycache)
        seconds, cpu, report = run_command(name, args.pycache)
        roles = report["roles"]
        assert isinstance(roles, list)
        busiest = float(report["max_total_bytes"]) / 2**30  # type: ignore[arg-type]
        print(
            f"{name:>5}  {report['world_size']:>5}  {len(roles):>5}  {busiest:>11.2f}  "
            f"{seconds:>7.1f}  {cpu:>6.1f}"
        )
        if args.in_process:
            cold, cached = run_in_process(name)
            print(
                f"       dry_run() cold {cold:.1f} s; another layout through the cache {cached:.1f} s"
            )


if __name__ == "__main__":
    main()

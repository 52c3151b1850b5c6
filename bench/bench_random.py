"""What a replicated DTensor random op costs: dropout with hp-dtensor's default seed handling, and without.

Two ranks form one process group. Each rank times ``F.dropout`` of a ``64 x 256``
``Replicate()`` DTensor (``--rows``/``--cols``) in four variants, interleaved round by
round (minimum over rounds, the least-disturbed figure on a loaded machine):

- ``default``: no collective in steady state (README "Seeds"): each op compares the
  generator state with the one the last op left and records the state it leaves;
- ``every_op``: ``HYPER_PARALLEL_RNG_CHECK=every_op``, the earlier default: the ranks
  check that their generators agree before every op (one all-reduce of a fingerprint
  per replicated mesh axis);
- ``trusted``: after ``hyper_parallel.dtensor.manual_seed(seed, mesh)`` (torch's API: the
  caller vouches for the seeds), no check, nothing recorded;
- ``plain``: ``F.dropout`` of the local tensor (no DTensor at all).

It prints microseconds per call (wall clock, and the calling thread's CPU time, which
a loaded machine disturbs less; a collective's wait is in the wall clock only), the
ratios ``default / trusted`` (the goal: <= 1.1), ``every_op / trusted`` and
``trusted / plain`` for both, and the collectives per call of each variant
(``CommDebugMode``).

Run::

    uv run python bench/bench_random.py
    uv run python bench/bench_random.py --rounds 30 --calls 100 --rows 64 --cols 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hyper_parallel.platform_torch.launch import run_distributed  # noqa: E402


def _time_us(op: Callable[[], object], calls: int) -> tuple[float, float]:
    """Microseconds per call: wall clock, and this thread's CPU time (less hurt by load)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        op()
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    return wall / calls * 1e6, cpu / calls * 1e6


def _rank(rows: int, cols: int, rounds: int, calls: int) -> dict[str, Any]:
    import hyper_parallel.dtensor as hp
    from hyper_parallel.dtensor import _seeds

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = hp.distribute_tensor(torch.ones(rows, cols), mesh, [hp.Replicate()])
    local = x.to_local()
    F.dropout(x, p=0.1, training=True)  # the mesh's first random op: its one sync

    def use(variant: str) -> None:
        # the flag manual_seed(seed, mesh) sets, toggled here so all variants share a run
        _seeds._seed_sync.trusted = variant == "trusted"
        if variant == "every_op":
            os.environ[_seeds.CHECK_ENV_VAR] = "every_op"
        else:
            os.environ.pop(_seeds.CHECK_ENV_VAR, None)
        # the variable is read off the steady state only (after a reseed, say): mark it read
        _seeds._seed_sync.streams["cpu"].every_op = variant == "every_op"

    variants: dict[str, Callable[[], object]] = {
        "default": lambda: F.dropout(x, p=0.1, training=True),
        "every_op": lambda: F.dropout(x, p=0.1, training=True),
        "trusted": lambda: F.dropout(x, p=0.1, training=True),
        "plain": lambda: F.dropout(local, p=0.1, training=True),
    }
    comm: dict[str, dict[str, int]] = {}
    with warnings.catch_warnings():
        # back from "trusted", the default finds the generator moved by unrecorded draws
        warnings.simplefilter("ignore", hp.RandomSeedWarning)
        for name, op in variants.items():
            use(name)
            op()  # after a switch: its first call may differ (see above)
            with hp.CommDebugMode() as mode:
                op()
            comm[name] = dict(mode.counts())
        best = dict.fromkeys(variants, float("inf"))
        best_cpu = dict.fromkeys(variants, float("inf"))
        for _ in range(rounds):
            for name, op in variants.items():
                use(name)
                op()
                torch.distributed.barrier()
                wall, cpu = _time_us(op, calls)
                best[name] = min(best[name], wall)
                best_cpu[name] = min(best_cpu[name], cpu)
    use("default")
    return {"us": best, "cpu_us": best_cpu, "comm": comm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    per_rank = run_distributed(
        _rank, 2, args=(args.rows, args.cols, args.rounds, args.calls), timeout_s=600.0
    )
    us = {k: max(r["us"][k] for r in per_rank) for k in per_rank[0]["us"]}
    cpu = {k: max(r["cpu_us"][k] for r in per_rank) for k in per_rank[0]["cpu_us"]}
    print(f"dropout of a {args.rows}x{args.cols} Replicate DTensor, 2 ranks, min of {args.rounds}")
    for name, value in us.items():
        print(
            f"  {name:<8} {value:9.1f} us/call (thread CPU {cpu[name]:7.1f})  "
            f"collectives/call {per_rank[0]['comm'][name]}"
        )
    for label, t in (("wall", us), ("thread CPU", cpu)):
        print(
            f"  {label}: default / trusted = {t['default'] / t['trusted']:.2f} (goal <= 1.1), "
            f"every_op / trusted = {t['every_op'] / t['trusted']:.2f}, "
            f"trusted / plain = {t['trusted'] / t['plain']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

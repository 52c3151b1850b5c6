"""What a replicated DTensor random op costs: dropout with hp-dtensor's replica check, without it, plain.

Two ranks form one process group. Each rank times ``F.dropout`` of a ``64 x 256``
``Replicate()`` DTensor (``--rows``/``--cols``) in three variants, interleaved round by
round (minimum over rounds, the least-disturbed figure on a loaded machine):

- ``checked``: the default. Before drawing, the ranks check that their generators agree
  (one all-reduce of a fingerprint per replicated mesh axis, README "Seeds");
- ``trusted``: after ``hyper_parallel.dtensor.manual_seed(seed, mesh)`` (torch's API: the
  caller vouches for the seeds), no check and no collective;
- ``plain``: ``F.dropout`` of the local tensor (no DTensor at all).

It prints microseconds per call, the ratios ``checked / trusted`` and ``trusted / plain``,
and the collectives per call of each variant (``CommDebugMode``).

Run::

    uv run python bench/bench_random.py
    uv run python bench/bench_random.py --rounds 30 --calls 100 --rows 64 --cols 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hyper_parallel.platform_torch.launch import run_distributed  # noqa: E402


def _time_us(op: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        op()
    return (time.perf_counter() - start) / calls * 1e6


def _rank(rows: int, cols: int, rounds: int, calls: int) -> dict[str, Any]:
    import hyper_parallel.dtensor as hp
    from hyper_parallel.dtensor import _seeds

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = hp.distribute_tensor(torch.ones(rows, cols), mesh, [hp.Replicate()])
    local = x.to_local()
    F.dropout(x, p=0.1, training=True)  # the mesh's first random op: its one sync

    def trusted(on: bool) -> None:
        # the flag manual_seed(seed, mesh) sets; toggled here so both variants share a run
        _seeds._seed_sync.trusted = on

    variants: dict[str, Callable[[], object]] = {
        "checked": lambda: F.dropout(x, p=0.1, training=True),
        "trusted": lambda: F.dropout(x, p=0.1, training=True),
        "plain": lambda: F.dropout(local, p=0.1, training=True),
    }
    comm: dict[str, dict[str, int]] = {}
    for name, op in variants.items():
        trusted(name == "trusted")
        with hp.CommDebugMode() as mode:
            op()
        comm[name] = dict(mode.counts())
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, op in variants.items():
            trusted(name == "trusted")
            torch.distributed.barrier()
            best[name] = min(best[name], _time_us(op, calls))
    trusted(False)
    return {"us": best, "comm": comm}


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
    print(f"dropout of a {args.rows}x{args.cols} Replicate DTensor, 2 ranks, min of {args.rounds}")
    for name, value in us.items():
        print(f"  {name:<8} {value:9.1f} us/call  collectives/call {per_rank[0]['comm'][name]}")
    print(f"  checked / trusted = {us['checked'] / us['trusted']:.2f}")
    print(f"  trusted / plain   = {us['trusted'] / us['plain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a replicated DTensor random op costs: dropout checked, in stream mode, trusted, plain.

Two ranks form one process group. Each rank times ``F.dropout`` of a ``64 x 256``
``Replicate()`` DTensor (``--rows``/``--cols``) in five variants, interleaved round by
round (minimum over rounds, the least-disturbed figure on a loaded machine):

- ``checked``: the default. Before drawing, the ranks check that their generators agree
  (one all-reduce of a fingerprint per replicated mesh axis, README "Seeds");
- ``stream``: ``set_random_sync("stream")`` in its steady state (the default generator
  holds the agreed stream: nothing else drew since the last DTensor random op), drawing
  in place with no collective;
- ``forked``: stream mode after a per-rank ``torch.manual_seed(100 + rank)``: every op
  draws from the stream in a fork (the user's generator is restored and ticked), no
  collective;
- ``trusted``: after ``hyper_parallel.dtensor.manual_seed(seed, mesh)`` (torch's API: the
  caller vouches for the seeds), no check and no collective;
- ``plain``: ``F.dropout`` of the local tensor (no DTensor at all).

It prints microseconds per call, the ratios ``checked / trusted``, ``stream / trusted``,
``forked / trusted``, ``stream / plain`` and ``trusted / plain``, and the collectives per
call of each variant (``CommDebugMode``). Interleaving moves the default generator between
variants, so before the ``stream`` variant the bench puts the stream's state back in the
default generator (what a job that draws nothing else between its DTensor random ops
holds), and before ``forked`` it reseeds per rank.

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
    rank = torch.distributed.get_rank()
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = hp.distribute_tensor(torch.ones(rows, cols), mesh, [hp.Replicate()])
    local = x.to_local()
    F.dropout(x, p=0.1, training=True)  # the mesh's first random op in check mode: its sync
    previous = hp.set_random_sync("stream")
    F.dropout(x, p=0.1, training=True)  # ... and in stream mode
    stream = _seeds._seed_sync.streams["cpu"]

    def enter(name: str) -> None:
        # the mode's and manual_seed's flags, set directly so that every variant shares one
        # run (set_random_sync would forget the stream, and manual_seed cannot be undone)
        _seeds._seed_sync.trusted = name == "trusted"
        _seeds._seed_sync.mode = "stream" if name in ("stream", "forked") else "check"
        if name == "stream" and stream.state is not None:
            torch.set_rng_state(stream.state)  # the steady state: nothing else drew
        if name == "forked":
            torch.manual_seed(100 + rank)  # per-rank seeds: every op forks
        if name == "checked":
            torch.manual_seed(0)  # equal seeds: the check passes (no re-sync after "forked")

    variants: dict[str, Callable[[], object]] = {
        "checked": lambda: F.dropout(x, p=0.1, training=True),
        "stream": lambda: F.dropout(x, p=0.1, training=True),
        "forked": lambda: F.dropout(x, p=0.1, training=True),
        "trusted": lambda: F.dropout(x, p=0.1, training=True),
        "plain": lambda: F.dropout(local, p=0.1, training=True),
    }
    comm: dict[str, dict[str, int]] = {}
    for name, op in variants.items():
        enter(name)
        with hp.CommDebugMode() as mode:
            op()
        comm[name] = dict(mode.counts())
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, op in variants.items():
            enter(name)
            torch.distributed.barrier()
            best[name] = min(best[name], _time_us(op, calls))
    enter("checked")
    hp.set_random_sync(previous)
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
    for over, under in (
        ("checked", "trusted"),
        ("stream", "trusted"),
        ("forked", "trusted"),
        ("stream", "plain"),
        ("trusted", "plain"),
    ):
        print(f"  {over} / {under:<7} = {us[over] / us[under]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-op dispatch overhead of hyper-parallel DTensor against torch DTensor, in the same run.

Two ranks form one process group; on tiny tensors (so the kernels cost next to
nothing) each rank times ``F.linear`` (input Replicate, weight ``Shard(0)``: no
communication), ``add`` and ``view`` on our DTensors and on torch's, interleaved
round by round, and reports the median microseconds per call and the ratio
ours / torch (below 1: ours is cheaper).

Run::

    uv run python bench/bench_dispatch.py            # default rounds
    uv run python bench/bench_dispatch.py --rounds 30 --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hyper_parallel.platform_torch.launch import run_distributed  # noqa: E402

Op = Callable[[], object]


def _time_us(op: Op, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        op()
    return (time.perf_counter() - start) / calls * 1e6


def _ops(torch_side: bool, device: str, world_size: int) -> dict[str, Op]:
    """The measured calls on one side (ours or torch's), with their inputs made once."""
    x: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    if torch_side:
        import torch.distributed.tensor as tdt
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        mesh = torch_mesh(device, (world_size,))
        x = tdt.distribute_tensor(torch.randn(4, 8, device=device), mesh, [tdt.Replicate()])
        w = tdt.distribute_tensor(torch.randn(8, 8, device=device), mesh, [tdt.Shard(0)])
        y = tdt.distribute_tensor(torch.randn(4, 8, device=device), mesh, [tdt.Replicate()])
    else:
        import hyper_parallel.dtensor as hdt

        our_mesh = hdt.init_device_mesh(device, (world_size,))
        x = hdt.distribute_tensor(torch.randn(4, 8, device=device), our_mesh, [hdt.Replicate()])
        w = hdt.distribute_tensor(torch.randn(8, 8, device=device), our_mesh, [hdt.Shard(0)])
        y = hdt.distribute_tensor(torch.randn(4, 8, device=device), our_mesh, [hdt.Replicate()])
    return {
        "linear": lambda: F.linear(x, w),
        "add": lambda: x + y,
        "view": lambda: x.view(8, 4),
    }


def bench_rank(
    rounds: int, calls: int, device: str = "cpu", world_size: int = 2
) -> dict[str, tuple[float, float]]:
    """On one rank: median µs/call of each op, ``(ours, torch)``, interleaved per round."""
    ours = _ops(torch_side=False, device=device, world_size=world_size)
    theirs = _ops(torch_side=True, device=device, world_size=world_size)
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ours}
    with torch.no_grad():
        for name in ours:  # warm up: fill both caches
            for _ in range(20):
                ours[name]()
                theirs[name]()
        for _ in range(rounds):
            for name in ours:
                samples[name][0].append(_time_us(ours[name], calls))
                samples[name][1].append(_time_us(theirs[name], calls))
    return {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in samples.items()}


def main() -> None:
    """Run the bench (default: 2 CPU ranks) and print a table (rank 0's numbers)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one rank per GPU)")
    parser.add_argument("--world-size", type=int, default=2)
    ns = parser.parse_args()
    results = run_distributed(
        bench_rank,
        ns.world_size,
        args=(ns.rounds, ns.calls, ns.device, ns.world_size),
        device_type=ns.device,
        timeout_s=600,
    )
    if ns.device != "cpu":  # kernels run asynchronously: the timings are launch overhead
        print(f"device {ns.device}: times are per-call dispatch (launch) overhead")
    print(f"{'op':<8} {'ours µs':>9} {'torch µs':>9} {'ours/torch':>10}")
    for name, (ours, theirs) in results[0].items():
        print(f"{name:<8} {ours:9.1f} {theirs:9.1f} {ours / theirs:10.2f}")


if __name__ == "__main__":
    main()

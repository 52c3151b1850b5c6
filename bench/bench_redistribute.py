"""Latency of redistribute: hp-dtensor vs torch.distributed.tensor, in the same run.

For each size and transition (S0->R, P->R, P->S0, S0->S1) both engines redistribute the
same local tensors on the same ranks; calls are interleaved (the order alternates every
iteration) and each call starts after a barrier. A call's latency is the slowest
rank's; the table shows medians, the ratio ours/torch and the collectives one call
issues (ours via ``collectives.observe_collectives``, torch's via ``CommDebugMode``).

Example::

    uv run python bench/bench_redistribute.py --world-size 2 --json /tmp/redistribute.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    collectives,
    init_device_mesh,
)
from hyper_parallel.platform_torch.launch import run_distributed

TRANSITIONS: dict[str, tuple[Placement, Placement]] = {
    "S0->R": (Shard(0), Replicate()),
    "P->R": (Partial(), Replicate()),
    "P->S0": (Partial(), Shard(0)),
    "S0->S1": (Shard(0), Shard(1)),
}


def _torch_placement(p: Placement) -> tdt.Placement:
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    if isinstance(p, Partial):
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _iterations(numel: int) -> int:
    """Fewer iterations for big tensors, so the whole run stays around a minute."""
    if numel <= 64 * 64:
        return 40
    if numel <= 512 * 512:
        return 20
    return 8


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _count_ours(fn: Callable[[], object]) -> int:
    kinds: list[str] = []
    with collectives.observe_collectives(lambda record: kinds.append(record.kind)):
        fn()
    return len(kinds)


def _count_torch(fn: Callable[[], object]) -> int:
    with CommDebugMode() as mode:  # type: ignore[no-untyped-call]
        fn()
    return int(mode.get_total_counts())


def _bench_rank(sizes: Sequence[int], warmup: int) -> list[dict[str, Any]]:
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    torch_mesh = torch_init_device_mesh("cpu", (world_size,))
    rows: list[dict[str, Any]] = []
    for size in sizes:
        shape = (size, size)
        local_shape = (size // world_size, size)
        for name, (src, dst) in TRANSITIONS.items():
            local = torch.randn(local_shape if isinstance(src, Shard) else shape)
            ours = DTensor.from_local(local, mesh, [src], shape=shape, stride=(size, 1))
            theirs = tdt.DTensor.from_local(
                local,
                torch_mesh,
                [_torch_placement(src)],
                shape=torch.Size(shape),
                stride=(size, 1),
            )

            def run_ours(x: DTensor = ours, d: Placement = dst) -> object:
                return x.redistribute(mesh, [d]).to_local()

            def run_torch(x: tdt.DTensor = theirs, d: Placement = dst) -> object:
                return x.redistribute(torch_mesh, [_torch_placement(d)]).to_local()

            if not torch.equal(run_ours(), run_torch()):  # type: ignore[arg-type]
                raise AssertionError(f"{name} {shape}: the engines disagree")
            for _ in range(warmup):
                run_ours()
                run_torch()
            iterations = _iterations(size * size)
            times = torch.zeros(2, iterations, dtype=torch.float64)
            for i in range(iterations):
                order = (0, 1) if i % 2 == 0 else (1, 0)
                for engine in order:
                    times[engine, i] = _timed(run_ours if engine == 0 else run_torch)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call lasts until its slowest rank
            ours_ms = statistics.median(times[0].tolist()) * 1e3
            torch_ms = statistics.median(times[1].tolist()) * 1e3
            rows.append(
                {
                    "transition": name,
                    "shape": list(shape),
                    "world_size": world_size,
                    "iterations": iterations,
                    "ours_ms": ours_ms,
                    "torch_ms": torch_ms,
                    "ratio": ours_ms / torch_ms,
                    "ours_collectives": _count_ours(run_ours),
                    "torch_collectives": _count_torch(run_torch),
                }
            )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table.

    Example::

        >>> print(format_table([]).splitlines()[0])
        | transition | shape | ranks | ours ms | torch ms | ours/torch | collectives ours/torch |
    """
    lines = [
        "| transition | shape | ranks | ours ms | torch ms | ours/torch | collectives ours/torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        shape = "x".join(str(s) for s in row["shape"])
        lines.append(
            f"| {row['transition']} | {shape} | {row['world_size']} | {row['ours_ms']:.3f} | "
            f"{row['torch_ms']:.3f} | {row['ratio']:.2f} | "
            f"{row['ours_collectives']}/{row['torch_collectives']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run the bench on ``--world-size`` local ranks, print and save results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="64,512,2048", help="square sizes, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    bad = [s for s in sizes if s % args.world_size]
    if bad:
        parser.error(
            f"--sizes: every size must be divisible by --world-size {args.world_size}; got {bad}"
        )
    results = run_distributed(
        _bench_rank, args.world_size, args=(sizes, args.warmup), timeout_s=args.timeout_s
    )
    rows = results[0]
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

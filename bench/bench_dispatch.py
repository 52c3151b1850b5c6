"""Per-op dispatch overhead of hyper-parallel DTensor against torch DTensor, in the same run.

Two ranks form one process group; on tiny tensors (so the kernels cost next to
nothing) each rank times ``F.linear`` (input Replicate, weight ``Shard(0)``: no
communication), ``add`` and ``view`` on our DTensors and on torch's, interleaved
round by round, and reports the median microseconds per call and the ratio
ours / torch (below 1: ours is cheaper).

``--steps`` times whole train steps instead (zero_grad, forward, backward and an
``AdamW(foreach=True)`` step of bench/step_bench.py's Megatron, torch DTensor and
hp-DTensor (every op a DTensor) implementations, interleaved) in **thread CPU time**
of rank 0: on a machine shared with other jobs, wall-clock ratios scatter by ±40%,
while CPU time leaves out the waits for a core (and for the collectives' peers).

Run::

    uv run python bench/bench_dispatch.py            # default rounds
    uv run python bench/bench_dispatch.py --rounds 30 --calls 200
    uv run python bench/bench_dispatch.py --steps --dims 256 512 --rounds 30
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


_STEPS = {
    "megatron": "bench.baselines.megatron:build_megatron_step",
    "torch_tp": "bench.baselines.torch_tp:build_torch_tp_step",
    "ours_dtensor": "bench.ours.llama_ref:build_dtensor_step",
}


def steps_rank(dims: list[int], rounds: int, layers: int) -> dict[int, dict[str, list[float]]]:
    """On one rank: per dim, each implementation's thread CPU ms per train step (interleaved)."""
    import torch.distributed as dist
    from bench.common.harness import TPContext
    from bench.common.llama import LlamaConfig, make_batch, make_full_weights
    from bench.common.runner import load_factory
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    torch.set_num_threads(1)
    world = dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    ctx = TPContext(
        rank=dist.get_rank(),
        world_size=world,
        group=group,
        torch_mesh=torch_mesh("cpu", (world,), mesh_dim_names=("tp",)),
    )
    out: dict[int, dict[str, list[float]]] = {}
    for dim in dims:
        cfg = LlamaConfig(dim=dim, n_layers=layers)
        weights = make_full_weights(cfg, 0)
        tokens, targets = make_batch(cfg, 0)
        steps = {name: load_factory(path)(cfg, weights, ctx) for name, path in _STEPS.items()}
        optimizers = {
            name: torch.optim.AdamW(
                [
                    {"params": [p for p in step.parameters() if type(p) is kind]}  # type: ignore[attr-defined]
                    for kind in {type(p) for p in step.parameters()}  # type: ignore[attr-defined]
                ],
                lr=1e-4,
                foreach=True,
            )
            for name, step in steps.items()
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        names = list(steps)
        for it in range(rounds + 3):
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:
                step = steps[name]
                dist.barrier(group=group)
                start = time.thread_time()
                step.zero_grad()
                torch.autograd.backward(step.forward_loss(tokens, targets))
                optimizers[name].step()
                if it >= 3:  # warm-up rounds
                    times[name].append((time.thread_time() - start) * 1e3)
        out[dim] = times
    return out


def _print_steps(results: dict[int, dict[str, list[float]]], world_size: int) -> None:
    for dim, times in results.items():
        base = times["torch_tp"]
        print(f"world_size={world_size} dim={dim}: thread CPU ms per train step, rank 0")
        print(f"  {'impl':<14} {'min':>8} {'median':>8} {'min/torch':>10} {'med/torch':>10}")
        for name, t in times.items():
            lo, mid = min(t), statistics.median(t)
            print(
                f"  {name:<14} {lo:8.2f} {mid:8.2f} {lo / min(base):10.3f}"
                f" {mid / statistics.median(base):10.3f}"
            )


def main() -> None:
    """Run the bench (default: 2 CPU ranks) and print a table (rank 0's numbers)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one rank per GPU)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--steps", action="store_true", help="time whole train steps (thread CPU time)"
    )
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--layers", type=int, default=2)
    ns = parser.parse_args()
    if ns.steps:
        steps = run_distributed(
            steps_rank,
            ns.world_size,
            args=(ns.dims, ns.rounds, ns.layers),
            timeout_s=1200,
        )
        _print_steps(steps[0], ns.world_size)
        return
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

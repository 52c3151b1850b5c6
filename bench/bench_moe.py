"""Expert parallelism: the MoE layer on 4 ranks with ep = 1, 2, 4 at a fixed global batch.

Run: uv run --frozen python bench/bench_moe.py [--tokens 4096] [--dim 64] [--hidden 128]
     [--experts 8] [--top-k 2] [--steps 5]

For each ep (dp_shard = 4, so ep borrows data-parallel ranks; efsdp = 4 / ep), every rank
routes its quarter of the global batch. Reported per ep:

- step time (forward + backward, the slowest rank's mean over ``--steps``) against one
  process computing the same layer on the whole batch, and against a naive EP that
  all-gathers every token over ``ep``, runs the local experts on all of them and
  reduce-scatters the outputs back (the dispatch an all-to-all replaces);
- expert bytes per rank over the whole experts' (goal: 1/ep);
- all-to-all bytes per rank per step (CommDebugMode's record: this rank's input bytes,
  forward and backward, token rows only, the rows a rank sends itself included) and the
  bytes of the rows that go to another rank, each against the minimum the routing needs:
  each (token, remote rank) pair sent once out and once back, forward and backward (a
  token with two experts on one rank is sent once);
- max/mean of the token-expert rows each rank's experts receive (the load balance).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.layers import MoE
from hyper_parallel.dtensor import CommDebugMode, DeviceMesh, DTensor, collectives
from hyper_parallel.platform_torch.launch import run_distributed

WORLD = 4


class _GatherTokens(torch.autograd.Function):
    """All-gather rows over ``ep``; the backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return collectives.all_gather(x, mesh, "ep").flatten(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size = ctx.mesh.size(0)
        return collectives.reduce_scatter(
            grad.reshape(size, -1, *grad.shape[1:]), ctx.mesh, "ep"
        ), None


class _ScatterOutputs(torch.autograd.Function):
    """Sum the partial outputs of every rank's experts and keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        size = mesh.size(0)
        return collectives.reduce_scatter(y.reshape(size, -1, *y.shape[1:]), mesh, "ep")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return collectives.all_gather(grad, ctx.mesh, "ep").flatten(0, 1), None


def _naive_ep(model: MoE, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every token to every ep rank; each rank's experts on the tokens routed to them."""
    cfg = model.config
    everything = _GatherTokens.apply(x, mesh)
    weights, experts, _ = model.router(everything)
    w1 = model.experts.w1
    local_n = w1.to_local().shape[0] if isinstance(w1, DTensor) else cfg.num_experts
    first = mesh.get_local_rank("ep") * local_n
    mine = (experts >= first) & (experts < first + local_n)
    pair_ids = mine.reshape(-1).nonzero().squeeze(1)
    local_experts = experts.reshape(-1)[pair_ids] - first
    order = torch.argsort(local_experts, stable=True)
    pair_ids = pair_ids[order]
    token_of = pair_ids // cfg.top_k
    counts = torch.bincount(local_experts, minlength=local_n)
    routed = model.experts(everything[token_of], counts)
    routed = routed * weights.reshape(-1)[pair_ids].unsqueeze(-1)
    partial = torch.zeros_like(everything).index_add(0, token_of, routed)
    out: torch.Tensor = _ScatterOutputs.apply(partial, mesh)
    return out


def _step(model: MoE, x: torch.Tensor) -> None:
    model(x).sum().backward()  # type: ignore[no-untyped-call]


def _naive_step(model: MoE, x: torch.Tensor, mesh: DeviceMesh) -> None:
    _naive_ep(model, x, mesh).sum().backward()  # type: ignore[no-untyped-call]


def _timed(fn: Any, steps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _rank_main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = MoE.Config(
        dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts, top_k=args.top_k
    )
    torch.manual_seed(0)
    x_all = torch.randn(args.tokens, args.dim)
    rank = torch.distributed.get_rank()
    rows = args.tokens // WORLD
    # an activation, as inside a model: its gradient is needed, so the backward moves it back
    x = x_all[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    results: dict[str, Any] = {}
    world = DeviceMesh("cpu", torch.arange(WORLD), mesh_dim_names=("world",))
    if rank == 0:
        torch.manual_seed(1)
        single = cfg.build()
        single.init_states()
        x_whole = x_all.clone().requires_grad_()
        results["single"] = _timed(functools.partial(_step, single, x_whole), args.steps)
    for ep in (1, 2, 4):
        dims = ParallelDims(dp_shard=WORLD, ep=ep)
        torch.manual_seed(1)
        model = cfg.build()
        model.init_states()
        model.parallelize(dims)
        ep_mesh = dims.get_mesh("ep")
        collectives.all_reduce(torch.zeros(1), world, "world")  # line the ranks up
        t = _timed(functools.partial(_step, model, x), args.steps)
        slowest = float(collectives.all_reduce(torch.tensor([t]), world, "world", "max")[0])
        naive = None
        if ep > 1:
            with torch.no_grad():  # the naive dispatch computes the same layer
                torch.testing.assert_close(_naive_ep(model, x, ep_mesh), model(x))
            collectives.all_reduce(torch.zeros(1), world, "world")
            tn = _timed(functools.partial(_naive_step, model, x, ep_mesh), args.steps)
            naive = float(collectives.all_reduce(torch.tensor([tn]), world, "world", "max")[0])
        local = sum(
            _local(p).numel() * _local(p).element_size() for p in model.experts.parameters()
        )
        full = 3 * cfg.num_experts * cfg.dim * cfg.hidden_dim * 4
        with CommDebugMode() as comm:
            _step(model, x)
        moves = [r for r in comm.records() if r.kind == "all_to_all"]
        token_bytes = sum(r.nbytes for r in moves[1:])  # the first one exchanges the counts
        # the minimum: each (token, remote rank) pair once out and once back, twice (fwd, bwd)
        with torch.no_grad():
            _, experts, _ = model.router(x)
        per_rank = cfg.num_experts // ep
        owner = experts // per_rank
        me = ep_mesh.get_local_rank("ep")
        remote_tokens = sum(int(((owner == r).any(-1)).sum()) for r in range(ep) if r != me)
        row_moves = args.dim * 4 * 4  # float32 rows, 4 moves
        minimum = remote_tokens * row_moves
        remote_rows = int((owner != me).sum()) * row_moves
        counts = torch.bincount(experts.reshape(-1), minlength=cfg.num_experts)
        counts = collectives.all_reduce(counts, world, "world", "sum")  # every batch rank's rows
        received = counts.reshape(ep, per_rank).sum(1).float() / (WORLD // ep)
        results[f"ep{ep}"] = {
            "step_s": slowest,
            "naive_s": naive,
            "expert_bytes_share": local / full,
            "a2a_bytes": token_bytes,
            "a2a_min_bytes": minimum,
            "a2a_remote_bytes": remote_rows,
            "load_max_over_mean": float(received.max() / received.mean()),
        }
    return results


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    per_rank = run_distributed(_rank_main, WORLD, args=(args,), timeout_s=900)
    single = per_rank[0]["single"]
    print(f"one process, {args.tokens} tokens: {single * 1e3:.1f} ms/step")
    print(
        "ep | step ms | 1-proc/step | naive/step | expert bytes/rank "
        "| a2a bytes / min | to other ranks / min | load max/mean"
    )
    for ep in (1, 2, 4):
        rows = [r[f"ep{ep}"] for r in per_rank]
        step = rows[0]["step_s"]
        naive = rows[0]["naive_s"]
        a2a = statistics.mean(r["a2a_bytes"] for r in rows)
        minimum = statistics.mean(r["a2a_min_bytes"] for r in rows)
        remote = statistics.mean(r["a2a_remote_bytes"] for r in rows)
        print(
            f"{ep:>2} | {step * 1e3:7.1f} | {single / step:11.2f} | "
            f"{'-' if naive is None else f'{naive / step:10.2f}'} | "
            f"{rows[0]['expert_bytes_share']:17.3f} | "
            f"{'-' if minimum == 0 else f'{a2a / minimum:15.2f}'} | "
            f"{'-' if minimum == 0 else f'{remote / minimum:20.2f}'} | "
            f"{rows[0]['load_max_over_mean']:.2f}"
        )


if __name__ == "__main__":
    main()

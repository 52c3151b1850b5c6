"""FSDP cost: hp's ``fully_shard`` against torch's FSDP2 on the bench Llama, 4 ranks.

Run: uv run --frozen python bench/bench_fsdp.py [--layers 2] [--dim 128] [--steps 3] [--rounds 3]

Three configurations on 4 ranks: FSDP dp=4, FSDP x TP (dp=2, tp=2), HSDP (replicate 2,
shard 2). Each rank process builds the same model twice, once per side (hp: hp's
``parallelize_module`` + ``fully_shard``; torch: torch's), loads the same full weights,
and the two sides train alternately, ``--steps`` AdamW steps per round, ``--rounds``
rounds: the step time of a round is the slowest rank's mean, and the ratio hp / torch
is reported on the minimum over rounds (the least disturbed run on a shared machine).

Deterministic figures, independent of load:

- collectives per step and the bytes each rank sends into them, counted on both sides
  by the same dispatcher-level counter (``bench/common/comm_count.py``'s op names; an
  all-gather's input is its smallest tensor argument, a reduce-scatter's its largest);
- parameter + gradient + optimizer-state bytes per rank in a step (the local shards,
  gradients present), against torch's and against the ideal full state / (dp_shard x tp)
  (under FSDP x TP the embedding, norms and output are not TP-sharded, so the ideal is
  not reachable there); and the state of the old replicated data parallelism (every dp
  rank the TP shard of the whole model, its gradients and both AdamW moments) over
  FSDP's: the memory gain, ideally dp_shard x.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.tensor as torch_dt
import torch.distributed.tensor.parallel as torch_tp
from bench.common.comm_count import _COLLECTIVE_NAMESPACES, _KIND_OF_OP, CollectiveCounter
from bench.common.llama import (
    Llama,
    LlamaConfig,
    cross_entropy_loss,
    make_batch,
    make_full_weights,
)

import hyper_parallel.dtensor as hp_dt
import hyper_parallel.dtensor.fsdp as hp_fsdp
import hyper_parallel.dtensor.parallel as hp_tp
from hyper_parallel.platform_torch.launch import run_distributed

CONFIGS: dict[str, tuple[tuple[int, int], tuple[str, str] | tuple[str]]] = {
    "fsdp": ((4, 1), ("dp",)),
    "fsdp_tp": ((2, 2), ("dp", "tp")),
    "hsdp": ((2, 2), ("rep", "dp")),
}


class ByteCounter(CollectiveCounter):  # type: ignore[no-untyped-call]
    """Counts collectives by kind and the bytes this rank puts into them."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        schema = getattr(func, "_schema", None)
        if schema is not None and not any(t is not torch.Tensor for t in types):
            namespace, _, op = schema.name.partition("::")
            kind = _KIND_OF_OP.get(op)
            if namespace in _COLLECTIVE_NAMESPACES and kind is not None:
                sizes = [t.numel() * t.element_size() for t in _tensors(args)]
                if sizes:
                    pick = min if kind == "all_gather" else max
                    self.nbytes[kind] = self.nbytes.get(kind, 0) + pick(sizes)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    return []


def _local(t: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return local


def _tp_numel(p: Any) -> int:
    """Elements of ``p``'s TP shard (what a rank holds without FSDP)."""
    names = p.device_mesh.mesh_dim_names
    if "tp" not in names or not p.placements[names.index("tp")].is_shard():
        return int(p.numel())
    return int(p.numel()) // int(p.device_mesh.size(names.index("tp")))


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                total += _local(v).numel() * v.element_size()
    return total


def _build(side: str, cfg: LlamaConfig, name: str) -> tuple[torch.nn.Module, Any]:
    dt, tp, fsdp = (hp_dt, hp_tp, hp_fsdp) if side == "hp" else (torch_dt, torch_tp, torch_fsdp)
    shape, names = CONFIGS[name]
    mesh = dt.init_device_mesh("cpu", shape[: len(names)], mesh_dim_names=names)
    model = Llama(cfg)
    model.load_state_dict(make_full_weights(cfg, seed=0))
    dp_mesh = mesh
    if name == "fsdp_tp":
        plan = {
            "attention.wq": tp.ColwiseParallel(),
            "attention.wk": tp.ColwiseParallel(),
            "attention.wv": tp.ColwiseParallel(),
            "attention.wo": tp.RowwiseParallel(),
            "feed_forward.w1": tp.ColwiseParallel(),
            "feed_forward.w3": tp.ColwiseParallel(),
            "feed_forward.w2": tp.RowwiseParallel(),
        }
        for layer in model.layers:
            tp.parallelize_module(layer, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=dp_mesh)
    fsdp.fully_shard(model, mesh=dp_mesh)
    return model, mesh


def _dp_rank(name: str, mesh: Any) -> tuple[int, int]:
    if name == "fsdp":
        return mesh.get_local_rank(0), 4
    if name == "hsdp":
        return mesh.get_local_rank(0) * 2 + mesh.get_local_rank(1), 4
    return mesh.get_local_rank("dp"), 2


def _rank(cfg_args: dict[str, int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = LlamaConfig(dim=cfg_args["dim"], n_layers=cfg_args["layers"], seq=32, batch=2)
    results: dict[str, Any] = {}
    for name in CONFIGS:
        sides: dict[str, Any] = {}
        for side in ("hp", "torch"):
            model, mesh = _build(side, base, name)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            rank, dp = _dp_rank(name, mesh)
            tokens, targets = make_batch(
                LlamaConfig(dim=base.dim, n_layers=base.n_layers, seq=32, batch=2 * dp), seed=0
            )
            mine = slice(rank * 2, rank * 2 + 2)
            sides[side] = (model, opt, tokens[mine], targets[mine])

        def step(side: str, count: ByteCounter | None = None, sides: Any = sides) -> float:
            model, opt, x, y = sides[side]
            start = time.perf_counter()
            if count is not None:
                with count:
                    cross_entropy_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            else:
                cross_entropy_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - start

        out: dict[str, Any] = {"times": {"hp": [], "torch": []}}
        for side in ("hp", "torch"):
            step(side)  # warm-up: lazy init, optimizer states
            counter = ByteCounter()
            step(side, counter)
            out[f"counts_{side}"] = dict(counter.counts)
            out[f"bytes_{side}"] = dict(counter.nbytes)
            model, opt, x, y = sides[side]
            # the state of a step: grads present (the next backward leaves them)
            cross_entropy_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            out[f"state_{side}"] = _state_bytes(model, opt)
            opt.zero_grad()
        for _ in range(cfg_args["rounds"]):
            for side in ("hp", "torch"):
                dist.barrier()
                t = sum(step(side) for _ in range(cfg_args["steps"])) / cfg_args["steps"]
                out["times"][side].append(t)
        model = sides["hp"][0]
        full = sum(p.numel() for p in model.parameters()) * 4
        out["full_state"] = 4 * full  # params + grads + two AdamW moments, fp32
        dp_shard, tp = {"fsdp": (4, 1), "fsdp_tp": (2, 2), "hsdp": (2, 1)}[name]
        out["ideal"] = out["full_state"] / (dp_shard * tp)
        # the old replicated data parallelism: every dp rank the TP shard of the whole state
        out["replicated"] = 4 * 4 * sum(_tp_numel(p) for p in model.parameters())
        results[name] = out
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ranks = run_distributed(_rank, 4, args=(vars(args),), device_type="cpu", timeout_s=1800.0)
    print(f"bench Llama: {args.layers} layers, dim {args.dim}, seq 32, 2 sequences per dp rank")
    print(
        "| config | step hp/torch (min over rounds) | state bytes/rank hp | hp/torch | "
        "hp/(full/(dp_shard x tp)) | replicated dp / hp | collectives per step hp (torch) | bytes hp/torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        per_rank = [r[name] for r in ranks]
        rounds = len(per_rank[0]["times"]["hp"])
        slowest = {
            side: [max(r["times"][side][i] for r in per_rank) for i in range(rounds)]
            for side in ("hp", "torch")
        }
        ratio = min(slowest["hp"]) / min(slowest["torch"])
        state_hp = max(r["state_hp"] for r in per_rank)
        state_torch = max(r["state_torch"] for r in per_rank)
        first = per_rank[0]
        sent_hp = sum(first["bytes_hp"].values())
        sent_torch = sum(first["bytes_torch"].values())
        print(
            f"| {name} | {ratio:.2f} | {state_hp} | {state_hp / state_torch:.3f} | "
            f"{state_hp / first['ideal']:.3f} | {first['replicated'] / state_hp:.2f} | "
            f"{first['counts_hp']} ({first['counts_torch']}) | {sent_hp}/{sent_torch} |"
        )


if __name__ == "__main__":
    main()

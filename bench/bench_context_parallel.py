"""Context parallelism: activation memory, step time, bytes and attention balance per algorithm.

Run: uv run python bench/bench_context_parallel.py [--seq 1024] [--dim 256] [--layers 2]
     [--rounds 3] [--balance-seq 4096]

4 ranks (CPU/gloo), llama-ref with ``n_heads=8, n_kv_heads=4`` (so ``alltoall`` runs at
cp=4). Each cp group trains on the same batch (1 x ``--seq`` tokens: the tokens of a
group are fixed); cp = 1, 2, 4 on a ``("dp", "cp")`` mesh of 4 ranks, for each algorithm.

- Activation memory per rank (load-independent): the bytes autograd saves for backward
  in one forward (``saved_tensors_hooks``; parameters and tensors sharing one storage
  counted once), max over ranks, against cp=1. Goal (issue 27): within 10% of 1/cp.
- Step time: forward + backward of ``model.loss``, slowest rank, minimum over
  interleaved rounds, against cp=1 (under load, indicative only).
- Bytes per step on mesh axis ``cp`` (what ``CommDebugMode`` records: each collective's
  input bytes on this rank), attention's collectives only, against each algorithm's
  theory per layer with K/V of ``kv = batch * n_kv_heads * seq/cp * head_dim * 4`` bytes
  and Q of ``q = kv * n_heads / n_kv_heads``: allgather ``2 kv`` (all-gather) +
  ``2 cp kv`` (reduce-scatter of the gathered gradient); ring ``2 kv (cp-1)`` forward +
  ``2 kv (cp-1) + 2 kv cp`` backward (K/V again, then the K/V gradients travelling home);
  alltoall ``2 (2 q + 2 kv)`` (Q, K, V to heads and O back, and the same in backward).
  Gradient and loss all-reduces over cp are listed apart.
- Per-rank attention work, causal and packed (random document lengths), in one
  process for every cp rank (no communication, so no waiting is counted): the (query,
  key) pairs the mask lets through for the rank's queries, and the time of ring
  attention's forward + backward on the rank's blocks (blocks the mask hides are
  skipped, so this is where balance shows). Reported max / mean over ranks for the split
  the model uses (head-tail for causal, document-aware for packed), and for contrast
  head-tail and a contiguous split. Goal: max / mean <= 1.1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hyper_parallel.dmodule import _ring_attention as cpmod
from hyper_parallel.dmodule.context_parallel import (
    CP_ALGORITHMS,
    TokenLayout,
    balanced_assignment,
    head_tail_index,
)
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import collectives, init_device_mesh
from hyper_parallel.dtensor.collectives import CollectiveRecord
from hyper_parallel.platform_torch.launch import run_distributed

WORLD = 4
CPS = (1, 2, 4)
ATTENTION_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _config(dim: int, layers: int, seq: int, algorithm: str) -> Llama.Config:
    return Llama.Config(
        vocab_size=1024,
        dim=dim,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=dim * 3,
        max_seq_len=seq,
        context_parallel=algorithm,
    )


def _saved_bytes(model: Llama, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes saved for backward by one loss forward (parameters and shared storages once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    return total, loss


def measure(dim: int, layers: int, seq: int, rounds: int) -> dict[str, Any]:
    """On each rank: saved bytes, step seconds per round and cp bytes, per (algorithm, cp)."""
    torch.set_num_threads(1)
    tokens = torch.randint(0, 1024, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    models: dict[tuple[str, int], Llama] = {}
    for cp in CPS:
        mesh = init_device_mesh("cpu", (WORLD // cp, cp), mesh_dim_names=("dp", "cp"))
        for algorithm in CP_ALGORITHMS if cp > 1 else ("allgather",):
            torch.manual_seed(0)
            model = _config(dim, layers, seq, algorithm).build()
            model.init_weights()
            # the dp ranks only repeat the measurement: the model is parallelized over cp alone
            models[(algorithm, cp)] = model.parallelize(mesh["cp"]) if cp > 1 else model
    out: dict[str, Any] = {}
    for key, model in models.items():
        records: list[CollectiveRecord] = []
        with collectives.observe_collectives(records.append):
            saved, loss = _saved_bytes(model, tokens)
            torch.autograd.backward(loss)
        model.zero_grad()
        attention = sum(r.nbytes for r in records if r.kind in ATTENTION_KINDS)
        other = sum(r.nbytes for r in records if r.kind not in ATTENTION_KINDS)
        out[f"{key[0]}:{key[1]}"] = {
            "saved": saved,
            "attention_bytes": attention,
            "other_bytes": other,
            "seconds": [],
        }
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for key, model in models.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            torch.autograd.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
            out[f"{key[0]}:{key[1]}"]["seconds"].append(time.perf_counter() - start)
            model.zero_grad()
    for found in out.values():
        found["seconds"] = found["seconds"][1:]
    return out


def theory_bytes(algorithm: str, cp: int, seq: int, dim: int, layers: int) -> int:
    """Attention's recorded bytes per step on one rank, per the algorithm (see the module doc)."""
    head_dim = dim // 8
    kv = 4 * (seq // cp) * head_dim * 4
    q = 2 * kv
    if algorithm == "allgather":
        per_layer = 2 * kv + 2 * cp * kv
    elif algorithm == "ring":
        per_layer = 2 * kv * (cp - 1) * 2 + 2 * kv * cp
    else:
        per_layer = 2 * (2 * q + 2 * kv)
    return layers * per_layer


# -- attention balance, every cp rank simulated in one process ------------------------------------
class _FakeCp:
    """A cp coordinate without a process group (compute only: the ring's transfers are skipped)."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank, self.algorithm = size, rank, "ring"


def _contiguous_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    chunk = seq // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def _random_documents(seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(16, seq // 4, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - seq
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def balance(seq: int, cp: int, packed: bool, rounds: int) -> dict[str, float]:
    """max/mean over cp ranks of visible pairs (as split, head-tail, contiguous) and ring time.

    "as split" is what the model uses: head-tail for a causal batch, the document-aware
    :func:`balanced_assignment` for a packed one.
    """
    docs = _random_documents(seq, 1) if packed else None
    heads, kv_heads, head_dim = 8, 4, 32
    if docs is not None:
        assignment, chunk = balanced_assignment(docs, cp)
    else:
        assignment, chunk = tuple(head_tail_index(seq, cp, r) for r in range(cp)), seq // (2 * cp)
    splits = {
        "used": list(assignment),
        "head-tail": [head_tail_index(seq, cp, r) for r in range(cp)],
        "contiguous": [_contiguous_index(seq, cp, r) for r in range(cp)],
    }
    pairs: dict[str, list[int]] = {name: [] for name in splits}
    for name, indices in splits.items():
        for index in indices:
            layout = TokenLayout(index[None], index, seq, docs, None)
            pairs[name].append(int(layout.mask(index, torch.arange(seq)).sum()))
    original_shift = cpmod._shift
    cpmod._shift = lambda tensor, cp: tensor.clone()  # type: ignore[assignment,misc]
    seconds = [float("inf")] * cp
    try:
        for _ in range(rounds):
            for rank in range(cp):
                index = assignment[rank]
                fake: Any = _FakeCp(cp, rank)
                layout = TokenLayout(index[None], index, seq, docs, fake, assignment, chunk)
                q = torch.randn(1, heads, seq // cp, head_dim, requires_grad=True)
                k = torch.randn(1, kv_heads, seq // cp, head_dim, requires_grad=True)
                v = torch.randn(1, kv_heads, seq // cp, head_dim, requires_grad=True)
                start = time.perf_counter()
                torch.autograd.backward(cpmod.ring_attention(q, k, v, layout).sum())
                seconds[rank] = min(seconds[rank], time.perf_counter() - start)
    finally:
        cpmod._shift = original_shift  # type: ignore[assignment]

    def ratio(values: list[float] | list[int]) -> float:
        return max(values) / (sum(values) / len(values))

    return {
        "pairs_used": ratio(pairs["used"]),
        "pairs_head_tail": ratio(pairs["head-tail"]),
        "pairs_contiguous": ratio(pairs["contiguous"]),
        "ring_time": ratio(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--balance-seq", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"per-rank attention balance, seq {args.balance_seq} (max / mean over cp ranks)")
    print(
        f"{'cp':>3} {'batch':<8} {'pairs as split':>15} {'pairs head-tail':>16} "
        f"{'pairs contiguous':>17} {'ring time':>10}"
    )
    for cp in (2, 4):
        for packed in (False, True):
            found = balance(args.balance_seq, cp, packed, args.rounds)
            print(
                f"{cp:>3} {'packed' if packed else 'causal':<8} {found['pairs_used']:>15.3f} "
                f"{found['pairs_head_tail']:>16.3f} "
                f"{found['pairs_contiguous']:>17.3f} {found['ring_time']:>10.3f}"
            )
    ranks = run_distributed(
        measure,
        WORLD,
        args=(args.dim, args.layers, args.seq, args.rounds),
        timeout_s=args.timeout,
    )
    keys = list(ranks[0])
    base_saved = max(r["allgather:1"]["saved"] for r in ranks)
    base_time = min(max(r["allgather:1"]["seconds"][i] for r in ranks) for i in range(args.rounds))
    print(
        f"\nllama-ref dim {args.dim}, {args.layers} layers, 1 x {args.seq} tokens per cp group, "
        f"{WORLD} ranks, {args.rounds} rounds"
    )
    print(
        f"{'algorithm':<10} {'cp':>3} {'saved MiB':>10} {'/ cp=1':>7} {'x cp':>6} "
        f"{'step / cp=1':>12} {'attn bytes':>11} {'/ theory':>9} {'grad+loss bytes':>16}"
    )
    for key in keys:
        algorithm, cp_text = key.split(":")
        cp = int(cp_text)
        saved = max(r[key]["saved"] for r in ranks)
        step = min(max(r[key]["seconds"][i] for r in ranks) for i in range(args.rounds))
        attn = max(r[key]["attention_bytes"] for r in ranks)
        theory = theory_bytes(algorithm, cp, args.seq, args.dim, args.layers) if cp > 1 else 0
        print(
            f"{algorithm if cp > 1 else '-':<10} {cp:>3} {saved / 2**20:>10.2f} "
            f"{saved / base_saved:>7.3f} {saved / base_saved * cp:>6.3f} {step / base_time:>12.3f} "
            f"{attn:>11} {(attn / theory if theory else 0.0):>9.3f} "
            f"{max(r[key]['other_bytes'] for r in ranks):>16}"
        )


if __name__ == "__main__":
    main()

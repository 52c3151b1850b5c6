"""Step bench: Llama-style tensor-parallel train steps (forward + backward) of several
implementations, interleaved in one process group so machine noise hits them alike.

    uv run python bench/step_bench.py --world-sizes 2 4 --dims 128 256 512 \\
        --iters 20 --warmup 5 --json out/bench_step.json

Before timing, every implementation's loss and gathered gradients must match the
single-device reference (``bench.common.llama.loss_and_grads``); a mismatch or an
implementation that raises is printed loudly and makes the exit code 1. An implementation
whose module cannot be imported is reported as skipped. ``--optimizer`` adds an AdamW
(``foreach=True``, a param group per tensor type) step to every timed step, the whole train
step a user runs (each implementation's optimizer over its own parameters: local shards for
Megatron, DTensors for the others), and reports the optimizer step's function calls apart.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from bench.common.llama import LlamaConfig
from bench.common.runner import BenchJob, preload_rank_imports, run_bench_rank

from hyper_parallel.platform_torch.launch import run_distributed

# name -> "module:factory"; a factory builds a TrainStep from (cfg, full_weights, TPContext).
# Add an implementation with one entry. Baseline names used for ratios: MEGATRON, TORCH_TP.
IMPLEMENTATIONS: dict[str, str] = {
    "megatron": "bench.baselines.megatron:build_megatron_step",
    "torch_tp": "bench.baselines.torch_tp:build_torch_tp_step",
    "spmd_types": "bench.baselines.spmd_types_tp:build_spmd_types_step",
    "ours_dtensor": "bench.ours.llama_ref:build_dtensor_step",
    "ours_local_map": "bench.ours.llama_ref:build_local_map_step",
    "ours_ref_region": "bench.ours.llama_ref:build_region_blocks_step",
    "ours_user_model": "bench.ours.user_model:build_user_model_step",
    "ours_tp_api": "bench.ours.tp_api:build_hp_tp_step",
    "ours_tp_api_no_overlap": "bench.ours.tp_api:build_hp_tp_step_no_overlap",
    "ours_compiled": "bench.ours.user_model:build_user_model_compiled_step",
    "ours_compiled_blocks": "bench.ours.user_model:build_user_model_compiled_blocks_step",
    "ours_nested": "bench.ours.user_model:build_user_model_nested_step",
    "ours_nested_compiled": "bench.ours.user_model:build_user_model_nested_compiled_step",
    "ours_region": "bench.ours.user_model:build_user_model_region_step",
    "ours_region_compiled": "bench.ours.user_model:build_user_model_region_compiled_step",
}
MEGATRON = "megatron"
TORCH_TP = "torch_tp"


def importable_implementations(
    implementations: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str]]:
    """Split implementations into (importable, skipped name -> reason).

    Example:
        >>> importable_implementations({"x": "no_such_module:f"})[1]["x"]
        "ModuleNotFoundError: No module named 'no_such_module'"
    """
    ok: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, path in implementations.items():
        module_name, _, attr = path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        if not callable(getattr(module, attr, None)):
            skipped[name] = f"{module_name} has no callable {attr!r}"
            continue
        ok[name] = path
    return ok, skipped


def summarize(
    per_rank: Sequence[Sequence[Mapping[str, Mapping[str, Any]]]],
    config_index: int,
    n_layers: int,
) -> dict[str, dict[str, Any]]:
    """Merge the ranks' results for one config: median and minimum over iterations of the
    slowest rank's time, parity from rank 0, collectives per step, and ratios vs the baselines
    (``ratio_vs_X`` of the medians, ``min_ratio_vs_X`` of the minima: the least-disturbed
    figure on a loaded machine).

    Example:
        >>> summarize([[{"a": {"status": "ok", "times_s": [1.0, 3.0]}}]], 0, 1)["a"]["median_ms"]
        2000.0
    """
    rank0 = per_rank[0][config_index]
    merged: dict[str, dict[str, Any]] = {}
    for name, first in rank0.items():
        entry: dict[str, Any] = {
            k: first.get(k)
            for k in (
                "status",
                "error",
                "loss",
                "loss_abs_diff",
                "grad_max_abs_diff",
                "parity_ok",
                "python_calls",
                "optimizer_calls",
            )
        }
        entry["comm_forward"] = first.get("comm_forward", {})
        entry["comm_backward"] = first.get("comm_backward", {})
        entry["comm_per_block"] = {
            "forward": {k: v / n_layers for k, v in entry["comm_forward"].items()},
            "backward": {k: v / n_layers for k, v in entry["comm_backward"].items()},
        }
        rank_times = [rank[config_index][name]["times_s"] for rank in per_rank]
        slowest = [max(ts) for ts in zip(*rank_times, strict=True)]
        entry["median_ms"] = statistics.median(slowest) * 1e3 if slowest else None
        entry["min_ms"] = min(slowest) * 1e3 if slowest else None
        merged[name] = entry
    for baseline in (MEGATRON, TORCH_TP):
        for stat, prefix in (("median_ms", "ratio_vs_"), ("min_ms", "min_ratio_vs_")):
            base = merged.get(baseline, {}).get(stat)
            for entry in merged.values():
                mine = entry[stat]
                entry[f"{prefix}{baseline}"] = mine / base if mine and base else None
    base_calls = merged.get(MEGATRON, {}).get("python_calls")
    for entry in merged.values():
        calls = entry.get("python_calls")
        entry["calls_vs_megatron"] = calls / base_calls if calls and base_calls else None
    return merged


def _fmt_comm(counts: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"


def print_table(
    world_size: int, cfg: LlamaConfig, summary: Mapping[str, Mapping[str, Any]]
) -> None:
    """Print one (world size, width) block: timings, ratios, parity and collectives."""
    minimum = 2 * cfg.n_layers
    width = max([16, *(len(name) + 2 for name in summary)])  # the name column fits every name
    print(
        f"\n== world_size={world_size} dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads}/"
        f"{cfg.n_kv_heads} ffn={cfg.hidden_dim} seq={cfg.seq} batch={cfg.batch} vocab={cfg.vocab}"
    )
    print(
        f"   {'impl':<{width}}{'median ms':>11}{'min ms':>9}{'/megatron':>11}{'min':>7}"
        f"{'/torch_tp':>11}{'min':>7}  parity (max|dgrad|)"
    )
    for name, e in summary.items():
        if e["status"] != "ok":
            print(f"!! {name:<{width}} ERROR: {e['error']}")
            continue
        cells = ""
        for b in (MEGATRON, TORCH_TP):
            med, low = e[f"ratio_vs_{b}"], e[f"min_ratio_vs_{b}"]
            cells += f"{med:>11.3f}" if med is not None else f"{'-':>11}"
            cells += f"{low:>7.3f}" if low is not None else f"{'-':>7}"
        parity = "ok" if e["parity_ok"] else "FAILED"
        flag = "  " if e["parity_ok"] else "!!"
        print(
            f"{flag} {name:<{width}}{e['median_ms']:>11.2f}{e['min_ms']:>9.2f}{cells}  {parity} "
            f"({e['grad_max_abs_diff']:.2e}; loss {e['loss_abs_diff']:.1e})"
        )
    print("   function calls per step (cProfile: Python and builtin calls; rank 0)")
    for name, e in summary.items():
        if e["status"] == "ok" and e.get("python_calls"):
            ratio = e.get("calls_vs_megatron")
            vs = f"  ({ratio:.2f}x megatron)" if ratio is not None else ""
            print(f"   {name:<{width}}{e['python_calls']:>9}{vs}")
    if any(e["status"] == "ok" and e.get("optimizer_calls") for e in summary.values()):
        print("   function calls of the optimizer step (AdamW, foreach; rank 0)")
        for name, e in summary.items():
            if e["status"] == "ok":
                print(f"   {name:<{width}}{e.get('optimizer_calls', 0):>9}")
    print(f"   collectives per step (Megatron minimum: all_reduce={minimum} fwd, {minimum} bwd)")
    for name, e in summary.items():
        if e["status"] == "ok":
            print(
                f"   {name:<{width}}fwd {_fmt_comm(e['comm_forward'])}; "
                f"bwd {_fmt_comm(e['comm_backward'])}"
            )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options (defaults finish in about two minutes on a 2-core CPU)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="time an AdamW(foreach=True) step after each backward (a whole train step); "
        "a param group per tensor type, since torch's DTensor refuses mixed foreach lists",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these implementations")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per world size")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; return 0 when every implementation ran and matched the reference.

    Example:
        >>> main(["--world-sizes", "2", "--dims", "32", "--iters", "2", "--warmup", "1"])  # doctest: +SKIP
        0
    """
    args = parse_args(argv)
    wanted = IMPLEMENTATIONS
    if args.only:
        unknown = sorted(set(args.only) - set(IMPLEMENTATIONS))
        if unknown:
            raise SystemExit(
                f"--only: unknown implementations {unknown}; known: {sorted(IMPLEMENTATIONS)}"
            )
        wanted = {k: v for k, v in IMPLEMENTATIONS.items() if k in args.only}
    implementations, skipped = importable_implementations(wanted)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    configs = tuple(
        LlamaConfig(
            vocab=args.vocab,
            dim=dim,
            n_heads=args.heads,
            n_kv_heads=args.kv_heads,
            n_layers=args.layers,
            seq=args.seq,
            batch=args.batch,
        )
        for dim in args.dims
    )
    for world_size in args.world_sizes:
        for cfg in configs:
            cfg.check_tensor_parallel(world_size)
    job = BenchJob(
        implementations=implementations,
        configs=configs,
        iters=args.iters,
        warmup=args.warmup,
        seed=args.seed,
        optimizer=args.optimizer,
    )
    preload_rank_imports(path.partition(":")[0] for path in implementations.values())
    results: list[dict[str, Any]] = []
    failed = False
    for world_size in args.world_sizes:
        per_rank = run_distributed(
            run_bench_rank, world_size, args=(job,), timeout_s=args.timeout_s
        )
        for index, cfg in enumerate(configs):
            summary = summarize(per_rank, index, cfg.n_layers)
            print_table(world_size, cfg, summary)
            failed = failed or any(
                e["status"] != "ok" or not e["parity_ok"] for e in summary.values()
            )
            results.append(
                {"world_size": world_size, "config": _config_dict(cfg), "impls": summary}
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads_per_rank": 1,
            "timing": (
                "median and minimum over iterations of the slowest rank's "
                "zero_grad+forward+backward" + ("+AdamW(foreach) step" if args.optimizer else "")
            ),
            "optimizer": (
                "AdamW(lr=1e-4, foreach=True), a param group per tensor type"
                if args.optimizer
                else None
            ),
        }
        payload = {"meta": meta, "skipped": skipped, "results": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if failed:
        print("\n!! PARITY FAILED or an implementation errored; see the '!!' lines above")
    return 1 if failed else 0


def _config_dict(cfg: LlamaConfig) -> dict[str, Any]:
    return {
        "vocab": cfg.vocab,
        "dim": cfg.dim,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "ffn_dim": cfg.hidden_dim,
        "n_layers": cfg.n_layers,
        "seq": cfg.seq,
        "batch": cfg.batch,
    }


if __name__ == "__main__":
    sys.exit(main())

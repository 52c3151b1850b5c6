"""Peak memory per rank when materialising the reference Llama: meta path vs build-full-then-shard.

Run: uv run python bench/bench_init_memory.py [--tp 2] [--layers 16]

Method: every configuration runs on fresh rank processes (``run_distributed``). In each
rank, after imports, the process group and the mesh exist, the peak resident set
size is reset (``/proc/self/clear_refs`` ← 5, Linux) and read back as the baseline
(``VmHWM`` in ``/proc/self/status``); after materialising it reads ``VmHWM`` again.
Where the reset is unavailable the baseline is ``getrusage(RUSAGE_SELF).ru_maxrss``.
Reported: (peak - baseline) / (full-model bytes / tp); the goal is <= 1.2.

- meta:  build under ``torch.device("meta")`` -> ``parallelize`` -> ``to_empty`` -> ``init_weights``
- full:  build on CPU -> ``init_weights`` -> ``parallelize`` (the full model exists on every rank)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import resource
from pathlib import Path

import torch

from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.platform_torch.launch import run_distributed

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset."""
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    with contextlib.suppress(OSError):  # no reset: the baseline is the peak so far
        _CLEAR_REFS.write_text("5")


def config(layers: int) -> Llama.Config:
    """The bench model (~12 M parameters per layer plus 8 M of embedding and output)."""
    return Llama.Config(
        vocab_size=4096,
        dim=1024,
        n_layers=layers,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=2816,
        max_seq_len=256,
    )


def materialise(mode: str, tp: int, layers: int) -> tuple[int, int, int]:
    """In one rank: ``(baseline bytes, peak bytes, full-model bytes)`` of materialising via ``mode``."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    cfg = config(layers)
    with torch.device("meta"):
        full_bytes = sum(p.numel() * p.element_size() for p in cfg.build().parameters())
    gc.collect()
    _reset_peak()
    baseline = _peak_rss_bytes()
    torch.manual_seed(0)
    if mode == "meta":
        with torch.device("meta"):
            model = cfg.build()
        model.parallelize(mesh)
        model.to_empty(device="cpu")
        model.init_weights()
    else:
        model = cfg.build()
        model.init_weights()
        model.parallelize(mesh)
    gc.collect()
    peak = _peak_rss_bytes()
    del model
    return baseline, peak, full_bytes


def main() -> None:
    """Run both paths on fresh processes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    mib = 1024 * 1024
    print(f"Llama bench model: {args.layers} layers, tp={args.tp}")
    print(f"{'path':<6} {'peak-baseline MiB (per rank)':>30} {'full/tp MiB':>12} {'ratio':>7}")
    for mode in ("meta", "full"):
        results = run_distributed(
            materialise, args.tp, args=(mode, args.tp, args.layers), timeout_s=600
        )
        worst = max(peak - base for base, peak, _ in results)
        share = results[0][2] / args.tp
        print(
            f"{mode:<6} {worst / mib:>30.1f} {share / mib:>12.1f} {worst / share:>7.2f}", flush=True
        )


if __name__ == "__main__":
    main()

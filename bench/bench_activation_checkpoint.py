"""Activation checkpointing: peak activation memory and step time, full and selective vs none.

Run: uv run python bench/bench_activation_checkpoint.py [--tp 2] [--layers 16] [--batch 1]
     [--seq 256] [--rounds 3]

The model is the bench Llama of ``bench_init_memory.py`` (16 layers, dim 1024, 197 M
parameters) parallelized by ``parallelize_llama`` at tp=2 on CPU/gloo; one model per
rank, whose blocks are switched between no checkpointing, ``mode="full"`` and
``mode="selective"`` (hp-dmodule's ``apply_activation_checkpointing``) between steps.

Memory (load-independent): each step's peak resident set size above the resident size
just before its forward, the max over ranks. The gradients exist already (a warm-up
step per mode; ``zero_grad(set_to_none=False)``), so the peak counts the saved
activations plus the step's transient buffers. glibc is told to ``mmap`` every block of
64 KiB or more (``mallopt``), so freed activations go back to the system and each step
starts from the same baseline. Time: one forward + backward per mode per round, the
modes interleaved, the slowest rank counts; reported: the ratio of the modes' minimum
times over the rounds (each mode's least disturbed step), and the median of the
per-round ratios next to it. Goals (issue 21): full / none memory <= 0.35,
time <= 1.4; selective in between.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from bench.bench_init_memory import _peak_rss_bytes, _reset_peak, config

from hyper_parallel.dmodule.activation_checkpoint import apply_activation_checkpointing
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.platform_torch.launch import run_distributed

MODES = ("none", "full", "selective")
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _mmap_large_blocks() -> None:
    """Make glibc return freed large blocks to the system, so RSS follows live memory."""
    name = ctypes.util.find_library("c")
    if name is not None:
        ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, 64 * 1024)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _set_mode(model: Llama, mode: str) -> None:
    for block in model.layers:
        vars(block).pop("forward", None)  # undo the previous mode (an instance attribute)
    apply_activation_checkpointing(model.layers, mode=mode)


def _step(model: Llama, tokens: torch.Tensor) -> tuple[float, int]:
    """Seconds and peak bytes above the pre-step RSS of one forward + backward."""
    model.zero_grad(set_to_none=False)
    torch.distributed.barrier()
    _reset_peak()
    baseline = _rss_bytes()
    start = time.perf_counter()
    torch.autograd.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
    seconds = time.perf_counter() - start
    return seconds, _peak_rss_bytes() - baseline


def measure(tp: int, layers: int, batch: int, seq: int, rounds: int) -> dict[str, Any]:
    """In one rank: per mode, the step seconds and peak bytes of every round."""
    _mmap_large_blocks()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    cfg = config(layers)
    with torch.device("meta"):
        model: Llama = cfg.build()
    parallelize_llama(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    found: dict[str, Any] = {mode: {"seconds": [], "peak": []} for mode in MODES}
    for mode in MODES:  # warm-up: gradients allocated, first-call costs paid
        _set_mode(model, mode)
        _step(model, tokens)
    for _ in range(rounds):
        for mode in MODES:
            _set_mode(model, mode)
            seconds, peak = _step(model, tokens)
            found[mode]["seconds"].append(seconds)
            found[mode]["peak"].append(peak)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    ranks = run_distributed(
        measure,
        args.tp,
        args=(args.tp, args.layers, args.batch, args.seq, args.rounds),
        timeout_s=args.timeout,
    )
    rounds = args.rounds
    peak = {m: max(max(r[m]["peak"]) for r in ranks) for m in MODES}
    seconds = {m: [max(r[m]["seconds"][i] for r in ranks) for i in range(rounds)] for m in MODES}
    print(
        f"bench Llama: {args.layers} layers, tp={args.tp}, batch {args.batch} x seq {args.seq}, "
        f"{rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'mode':<10} {'peak MiB':>9} {'/ none':>7} {'min s':>7} {'/ none':>7} {'median s':>9} {'/ none':>7}"
    )
    for mode in MODES:
        ratios = [s / n for s, n in zip(seconds[mode], seconds["none"], strict=True)]
        print(
            f"{mode:<10} {peak[mode] / 2**20:>9.1f} {peak[mode] / peak['none']:>7.3f} "
            f"{min(seconds[mode]):>7.2f} {min(seconds[mode]) / min(seconds['none']):>7.3f} "
            f"{statistics.median(seconds[mode]):>9.2f} {statistics.median(ratios):>7.3f}"
        )


if __name__ == "__main__":
    main()

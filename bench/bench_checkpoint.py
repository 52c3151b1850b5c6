"""Checkpoint cost: DCP save/load of hp DTensors vs torch DTensors, and load_hf's peak memory.

Run: uv run python bench/bench_checkpoint.py [--tp 2] [--layers 16] [--reps 3] [--dir DIR]

The model is the bench Llama of ``bench_init_memory.py`` (16 layers: 197 M parameters,
788 MB fp32) parallelized by hp-dmodule at tp=2. The baseline holds *the same shards*
as torch DTensors (``torch.distributed.tensor.DTensor.from_local`` of a copy of every
local shard, same placements, on a torch mesh over the same ranks; ours are hp
DTensors made the same way), so both sides write
and read identical bytes through the same ``torch.distributed.checkpoint`` engine
and only the DTensor classes differ.

Timing: both states live in the same rank processes; each repetition times
``dcp.save`` into an empty directory, then ``dcp.load`` into zeroed shards, ours and
torch's alternating (the slowest rank counts; the median over repetitions is
reported, and the minimum: on a shared machine the least disturbed run). Memory,
on fresh rank processes per side: peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) above the baseline taken once the state exists, the max
over ranks. Reported: ours / torch.

``load_hf``: a consolidated safetensors directory of the same model (written once by
``save_hf``) is loaded into a meta-built, parallelized, ``to_empty`` model; the
baseline is taken before ``to_empty``, so the peak counts the rank's shards plus
everything ``load_hf`` holds, over (full bytes / tp). Goals: save and load ratios
<= 1.1, load_hf <= 1.3.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench.*`` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed.tensor as tdt
from bench.bench_init_memory import _peak_rss_bytes, _reset_peak, config
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hyper_parallel.dmodule.checkpoint import load_hf, save_hf
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import DTensor, Placement, Replicate, Shard, init_device_mesh
from hyper_parallel.platform_torch.launch import run_distributed


def _ours(tp: int, layers: int) -> Llama:
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model: Llama = config(layers).build()
    model.parallelize(mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _torch_placement(p: Placement) -> tdt.Shard | tdt.Replicate:
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    assert isinstance(p, Replicate), p
    return tdt.Replicate()


def _state(impl: str, tp: int, layers: int) -> dict[str, Any]:
    """The model's shards as a state dict of fresh hp DTensors or torch DTensors.

    Both sides copy every shard out of the model and drop the model, so the
    allocator has the same history (freed blocks it may reuse) before the timing.
    """
    model = _ours(tp, layers)
    torch_mesh = torch_init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    state: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor)
        local = value.to_local().detach().clone()
        placements: list[Any] = list(value.placements)
        mesh: Any = value.device_mesh
        make: Any = DTensor.from_local
        if impl == "torch":
            placements = [_torch_placement(p) for p in value.placements]
            mesh, make = torch_mesh, tdt.DTensor.from_local
        state[key] = make(local, mesh, placements, shape=value.shape, stride=value.stride())
    del model
    gc.collect()
    return state


def _save_load(state: dict[str, Any], directory: str) -> tuple[float, float]:
    """Seconds of ``dcp.save`` into an empty directory, then of ``dcp.load`` into zeroed shards."""
    torch.distributed.barrier()
    start = time.perf_counter()
    dcp_save(state, checkpoint_id=directory)
    save_s = time.perf_counter() - start
    for value in state.values():
        value.to_local().zero_()
    torch.distributed.barrier()
    start = time.perf_counter()
    dcp_load(state, checkpoint_id=directory)
    load_s = time.perf_counter() - start
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return save_s, load_s


def timings(tp: int, layers: int, reps: int, scratch: str) -> dict[str, list[tuple[float, float]]]:
    """In one rank: both states side by side, saved and loaded alternately ``reps`` times."""
    states = {impl: _state(impl, tp, layers) for impl in ("ours", "torch")}
    found: dict[str, list[tuple[float, float]]] = {"ours": [], "torch": []}
    for rep in range(reps):
        for impl in ("ours", "torch") if rep % 2 == 0 else ("torch", "ours"):
            found[impl].append(_save_load(states[impl], f"{scratch}/{impl}-{rep}"))
    return found


def peak_memory(impl: str, tp: int, layers: int, directory: str) -> tuple[int, int]:
    """In fresh rank processes: peak bytes above the state of dcp.save, then of dcp.load."""
    state = _state(impl, tp, layers)
    gc.collect()
    _reset_peak()
    base = _peak_rss_bytes()
    dcp_save(state, checkpoint_id=directory)
    save_b = _peak_rss_bytes() - base
    for value in state.values():
        value.to_local().zero_()
    gc.collect()
    _reset_peak()
    base = _peak_rss_bytes()
    dcp_load(state, checkpoint_id=directory)
    return save_b, _peak_rss_bytes() - base


def write_hf(tp: int, layers: int, directory: str) -> None:
    save_hf(_ours(tp, layers), directory)


def load_hf_peak(tp: int, layers: int, directory: str) -> tuple[int, int]:
    """In one rank: (peak bytes above the pre-allocation baseline, full-model bytes)."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = config(layers).build()
    model.parallelize(mesh)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    _reset_peak()
    base = _peak_rss_bytes()
    model.to_empty(device="cpu")
    load_hf(model, directory)
    return _peak_rss_bytes() - base, full_bytes


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the comparison and print the table; return the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    scratch.mkdir(parents=True, exist_ok=True)
    mib = 1024 * 1024
    cfg = config(args.layers)
    with torch.device("meta"):
        nparams = sum(p.numel() for p in cfg.build().parameters())
    print(f"bench Llama: {args.layers} layers, {nparams / 1e6:.0f} M parameters, tp={args.tp}")
    try:
        per_rank = run_distributed(
            timings, args.tp, args=(args.tp, args.layers, args.reps, str(scratch)), timeout_s=1800
        )
        med: dict[str, dict[str, float]] = {}
        for impl in ("ours", "torch"):
            # the slowest rank of each repetition, then the median over repetitions
            saves = [max(r[impl][i][0] for r in per_rank) for i in range(args.reps)]
            loads = [max(r[impl][i][1] for r in per_rank) for i in range(args.reps)]
            med[impl] = {
                "save_s": statistics.median(saves),
                "load_s": statistics.median(loads),
                "save_min_s": min(saves),  # the least disturbed repetition (a loaded machine)
                "load_min_s": min(loads),
            }
            peaks = run_distributed(
                peak_memory,
                args.tp,
                args=(impl, args.tp, args.layers, str(scratch / f"mem-{impl}")),
                timeout_s=900,
            )
            shutil.rmtree(scratch / f"mem-{impl}", ignore_errors=True)
            med[impl]["save_b"] = max(p[0] for p in peaks)
            med[impl]["load_b"] = max(p[1] for p in peaks)
        print(f"{'':14}{'ours':>12}{'torch':>12}{'ours/torch':>12}")
        ratios: dict[str, float] = {}
        for key, label, scale in [
            ("save_s", "save s", 1.0),
            ("load_s", "load s", 1.0),
            ("save_min_s", "save s (min)", 1.0),
            ("load_min_s", "load s (min)", 1.0),
            ("save_b", "save MiB", mib),
            ("load_b", "load MiB", mib),
        ]:
            ours, theirs = med["ours"][key] / scale, med["torch"][key] / scale
            ratios[key] = ours / theirs if theirs > 0 else float("nan")
            print(f"{label:<14}{ours:>12.2f}{theirs:>12.2f}{ratios[key]:>12.2f}")
        hf = scratch / "hf"
        run_distributed(write_hf, args.tp, args=(args.tp, args.layers, str(hf)), timeout_s=900)
        peaks = run_distributed(
            load_hf_peak, args.tp, args=(args.tp, args.layers, str(hf)), timeout_s=900
        )
        worst, full = max(p for p, _ in peaks), peaks[0][1]
        ratios["load_hf"] = worst / (full / args.tp)
        print(
            f"load_hf peak per rank {worst / mib:.1f} MiB; full/tp {full / args.tp / mib:.1f} MiB; "
            f"ratio {ratios['load_hf']:.2f}"
        )
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return ratios


if __name__ == "__main__":
    main()

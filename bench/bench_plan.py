"""Time ``hp-train --plan`` on published shapes: Llama 3.1 70B on 64 x 80 GiB, 8B on 8 x 80 GiB.

Run: uv run python bench/bench_plan.py [--cases 8B-8 70B-64] [--json out/bench_plan.json]

Each case plans in a fresh process (``hp-train --plan --json``, imports included, as a
user runs it) and prints the wall seconds, the layouts measured and the best layout; before
it, the seconds a fresh process takes to import the planner and the dry run (the share of
the wall time that is not planning: on a loaded machine it is most of it).
The shapes are Llama 3.1's published ``config.json`` fields given as ``[model.config]``
overrides of llama-ref (the flavors ``8B`` / ``70B`` say the same where they exist).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LLAMA31 = {
    "8B": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336},
    "70B": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672},
}
#: case -> (shape, world size, global batch): TorchTitan's recipes' sequence 8192, local batch 1
CASES = {"8B-8": ("8B", 8, 8), "70B-64": ("70B", 64, 64)}


def _argv(shape: str, world: int, batch: int) -> list[str]:
    fields = {**LLAMA31[shape], "vocab_size": 128256, "max_seq_len": 8192, "rope_theta": 500000.0}
    return [
        "--model.name=llama-ref",
        f"--model.config={json.dumps(fields)}",
        "--training.seq_len=8192",
        f"--training.global_batch_size={batch}",
        "--training.param_dtype=bfloat16",
        "--plan",
        f"--world-size={world}",
        "--device-memory=80",
        "--device=h100",
        "--json",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", default="", help="write the figures here too")
    args = parser.parse_args()
    figures = []
    imports = [
        sys.executable,
        "-c",
        "import hyper_parallel.train.plan_report, hyper_parallel.train.dry_run",
    ]
    for case in args.cases:
        start = time.perf_counter()
        subprocess.run(imports, check=True)
        import_seconds = time.perf_counter() - start
        shape, world, batch = CASES[case]
        cmd = [sys.executable, "-m", "hyper_parallel.train", *_argv(shape, world, batch)]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        if done.returncode not in (0, 1):
            sys.exit(f"{case}: hp-train --plan failed ({done.returncode}):\n{done.stderr}")
        report = json.loads(done.stdout)
        best = report["candidates"][0]
        degrees = " ".join(f"{k}={v}" for k, v in best["parallelism"].items() if v > 1)
        row = {
            "case": case,
            "seconds": round(seconds, 1),
            "import_seconds": round(import_seconds, 1),
            "considered": report["layouts_considered"],
            "measured": report["layouts_measured"],
            "best": degrees,
            "activation_checkpoint": best["activation_checkpoint"],
            "best_gib": round(best["max_total_bytes"] / 2**30, 2),
            "fits": best["fits"],
            "estimated_step_seconds": round(best["estimated_step_seconds"], 3),
            "mfu": round(best["mfu"], 3),
        }
        figures.append(row)
        print(
            f"{case}: {seconds:.1f} s (imports alone: {import_seconds:.1f} s), {row['measured']} of {row['considered']} layouts measured; "
            f"best {degrees} AC {row['activation_checkpoint']} ({row['best_gib']} GiB, "
            f"step {row['estimated_step_seconds']} s, MFU {row['mfu']:.0%})",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

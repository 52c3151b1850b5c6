"""Time to build and parallelize a published flavor on the meta device, for one rank.

Nothing is allocated: the model is built under ``torch.device("meta")`` and parallelized
(tensor parallelism over ``tp``, FSDP over ``dp_shard``, by the spec's ``parallelize_fn``)
on rank 0 of torch's fake process group (``FakeStore``, backend ``"fake"``: every
collective returns at once), so one process plays one rank of a ``tp x dp_shard`` job.

Prints one line per phase with its seconds, in a fresh process each time (imports
included, as a user's first run would pay them)::

    uv run python bench/bench_meta_build.py --model llama-ref --flavor 405B --tp 8 --dp-shard 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

T_TORCH = time.perf_counter()

from hyper_parallel.dmodule import ParallelDims, get_spec  # noqa: E402

T_HP = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-ref")
    parser.add_argument("--flavor", default="405B")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp-shard", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    world = args.tp * args.dp_shard
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    spec = get_spec(args.model)
    config = spec.config(args.flavor)
    t_spec = time.perf_counter()
    with torch.device("meta"):
        model = config.build()
    t_build = time.perf_counter()
    dims = ParallelDims(dp_shard=args.dp_shard, tp=args.tp, world_size=world)
    assert spec.parallelize_fn is not None
    spec.parallelize_fn(model, dims)
    t_parallel = time.perf_counter()
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    assert not real, f"allocated for real: {real[:3]}"
    figures = {
        "model": args.model,
        "flavor": args.flavor,
        "world_size": world,
        "parameters": sum(p.numel() for p in model.parameters()),
        "import_torch_s": round(T_TORCH - T0, 2),
        "import_hp_s": round(T_HP - T_TORCH, 2),
        "spec_s": round(t_spec - T_HP, 2),
        "build_meta_s": round(t_build - t_spec, 2),
        "parallelize_s": round(t_parallel - t_build, 2),
        "build_and_parallelize_s": round(t_parallel - t_spec, 2),
        "dynamo_imported": "torch._dynamo" in sys.modules,
    }
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()

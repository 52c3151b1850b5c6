"""``hp-train --plan``'s outputs: the ranked table, the JSON, the best layout as a job file."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from hyper_parallel.config import ConfigError
from hyper_parallel.train.config import JobConfig, to_toml
from hyper_parallel.train.plan import GIB, Candidate, PlanRequest, PlanResult, plan
from hyper_parallel.train.plan_cost import MATMUL_EFFICIENCY, Layout, model_facts
from hyper_parallel.train.plan_devices import device_spec

__all__ = ["format_plan", "plan_command", "plan_json"]


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def _row(rank: str, c: Candidate) -> str:
    layout, e = c.layout, c.estimate
    axes = " ".join(f"{k}={v}" for k, v in layout.degrees().items() if v > 1) or "one rank"
    if layout.pp > 1:
        batch = f"{layout.pipeline_schedule} x{layout.pipeline_microbatches}"
    else:
        batch = f"accum {layout.gradient_accumulation_steps}"
    memory = _gib(None if c.measured is None else c.measured.max_total_bytes)
    return (
        f"  {rank:>3}  {axes:<34} {layout.activation_checkpoint:<9} {batch:<11} "
        f"{memory:>11}  {e.seconds:>9.4g}  {e.tokens_per_second:>12,.0f}  {100 * e.mfu:>5.1f}%"
    )


def format_plan(job: JobConfig, result: PlanResult) -> str:
    """The ranked table: the layouts that fit, best first, then the smallest that did not.

    Example::

        print(format_plan(job, plan(job, request, facts)))
    """
    request, device = result.request, result.request.device
    training = job.training
    lines = [
        f"plan: {job.model.name} ({job.model.flavor}), {result.facts.nparams:,} parameters, "
        f"sequence {training.seq_len}, global batch {training.global_batch_size}, "
        f"{training.param_dtype}; {request.world_size} x {device.name} "
        f"({request.device_memory_gib:g} GiB each, {request.node} per node)",
        f"  {result.considered} layouts; {result.measured} measured by the dry run, "
        f"{result.ruled_out} ruled out unmeasured (the dry run's bytes of layouts sharing "
        "their weight shards and microbatch exceed the budget)",
        f"  {'#':>3}  {'layout':<34} {'AC':<9} {'batch':<11} {'memory':>11}  "
        f"{'step (s)':>9}  {'tokens/s':>12}  {'MFU':>6}",
    ]
    fitting = [c for c in result.candidates if c.fits]
    lines += [_row(str(i), c) for i, c in enumerate(fitting[: request.top], 1)]
    if not fitting:
        lines.append("  (no layout fits)")
    over = [c for c in result.candidates if not c.fits]
    if over:
        lines.append(f"  over {request.device_memory_gib:g} GiB (the smallest measured):")
        lines += [_row("-", c) for c in over[:3]]
    lines.append(
        f"  estimates: {device.peak_tflops:g} TFLOPs peak at {MATMUL_EFFICIENCY:.0%}, "
        f"links {device.intra_node_gbps:g} GB/s in a node, {device.inter_node_gbps:g} GB/s "
        "across; FSDP hidden behind compute, tp/cp/ep not"
    )
    return "\n".join(lines)


def plan_json(job: JobConfig, result: PlanResult) -> dict[str, Any]:
    """The ``--json`` object: the candidates, ranked, and the plan's inputs.

    Example::

        json.dumps(plan_json(job, plan(job, request, facts)))
    """
    request = result.request
    return {
        "candidates": [c.to_json() for c in result.candidates],
        "world_size": request.world_size,
        "device": request.device.name,
        "device_memory_bytes": request.budget_bytes,
        "gpus_per_node": request.node,
        "model": {"name": job.model.name, "flavor": job.model.flavor},
        "parameters": result.facts.nparams,
        "layouts_considered": result.considered,
        "layouts_measured": result.measured,
        "layouts_ruled_out": result.ruled_out,
    }


def plan_command(
    job: JobConfig,
    *,
    world_size: int | None,
    device_memory_gib: float | None,
    device: str = "h100",
    gpus_per_node: int | None = None,
    peak_tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    as_json: bool = False,
    plan_out: str | None = None,
    top: int = 3,
    allow_imports: tuple[str, ...] = (),
) -> int:
    """Run ``hp-train --plan``: print the plan; 0 when a layout fits, 1 when none does.

    Bad input raises ConfigError naming the flag.

    Example::

        plan_command(job, world_size=8, device_memory_gib=80.0)
    """
    spec = device_spec(
        device,
        peak_tflops=peak_tflops,
        intra_node_gbps=intra_node_gbps,
        inter_node_gbps=inter_node_gbps,
        gpus_per_node=gpus_per_node,
    )
    if world_size is None or world_size < 1:
        raise ConfigError(
            f"expected --world-size N (the ranks to plan for, N >= 1), found "
            f"{'none' if world_size is None else world_size}",
            path="--world-size",
        )
    if device_memory_gib is None or not device_memory_gib > 0:
        raise ConfigError(
            f"expected --device-memory GIB (each rank's memory; a {spec.name} has "
            f"{spec.memory_gib:.0f}), found {'none' if device_memory_gib is None else device_memory_gib}",
            path="--device-memory",
        )
    if top < 1:
        raise ConfigError(f"expected an int >= 1, found {top}", path="--plan-top")
    from hyper_parallel.train.tokenizer import build_tokenizer
    from hyper_parallel.train.trainer import build_model_config

    # the planner picks every degree (the job's own are not a constraint)
    base = job.replace(parallelism=Layout().apply(job).parallelism)
    config = build_model_config(base, build_tokenizer(job.tokenizer.path).vocab_size, allow_imports)
    request = PlanRequest(world_size, device_memory_gib, spec, spec.gpus_per_node, top)
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the plan alone
        result = plan(base, request, model_facts(config, job.training.seq_len))
    if as_json:
        sys.stdout.write(json.dumps(plan_json(base, result)) + "\n")
    else:
        print(format_plan(base, result))
    best = result.best
    if best is None:
        smallest = result.smallest
        found = (
            "no layout could be measured"
            if smallest is None or smallest.measured is None
            else f"the smallest per-rank memory found is {_gib(smallest.measured.max_total_bytes)} "
            f"(ranks {list(smallest.measured.busiest_ranks)} of {smallest.layout.describe()})"
        )
        print(
            f"hp-train --plan: nothing fits in {device_memory_gib:g} GiB per rank on "
            f"{world_size} ranks: {found}. Add ranks or memory, or shorten training.seq_len",
            file=sys.stderr,
        )
        return 1
    if plan_out:
        Path(plan_out).write_text(to_toml(best.layout.apply(base)), encoding="utf-8")
        print(f"hp-train --plan: wrote {best.layout.describe()} to {plan_out}", file=sys.stderr)
    return 0

"""The per-rank body of the step bench: build each implementation, check parity, count
collectives, then time them interleaved in the same process group."""

from __future__ import annotations

import cProfile
import importlib
import math
import multiprocessing
import pstats
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing import forkserver
from typing import Any, cast

import torch
import torch.distributed as dist
from bench.common.comm_count import CollectiveCounter
from bench.common.harness import StepFactory, TPContext, TrainStep
from bench.common.llama import LlamaConfig, loss_and_grads, make_batch, make_full_weights
from torch.distributed.device_mesh import init_device_mesh

# What every rank imports: torch's DTensor pulls in sympy, and parallelize_module torch._dynamo
# (seconds per process each).
RANK_IMPORTS = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "hyper_parallel.platform_torch.launch",
    "bench.common.runner",
)


def preload_rank_imports(modules: Iterable[str] = ()) -> None:
    """Start the forkserver ``run_distributed`` forks its ranks from, with ``RANK_IMPORTS`` and
    ``modules`` imported once there instead of in every rank of every launch.

    No effect if this process's forkserver already runs. Call before the first launch.

    Example:
        >>> preload_rank_imports(["bench.baselines.megatron"])  # doctest: +SKIP
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*RANK_IMPORTS, *modules])
    forkserver.ensure_running()


@dataclass(frozen=True)
class BenchJob:
    """What every rank runs: implementations (name -> ``"module:factory"``) on each config."""

    implementations: Mapping[str, str]
    configs: tuple[LlamaConfig, ...]
    iters: int
    warmup: int
    seed: int = 0
    rtol: float = 1e-4
    atol: float = 1e-5
    optimizer: bool = False  # time an AdamW (foreach) step after each backward too


@dataclass
class ImplResult:
    """One implementation on one config, as seen by one rank (parity fields only on rank 0)."""

    status: str = "ok"  # "ok" | "error"
    error: str = ""
    loss: float = math.nan
    loss_abs_diff: float = math.nan
    grad_max_abs_diff: float = math.nan
    parity_ok: bool = False
    comm_forward: dict[str, int] = field(default_factory=dict)
    comm_backward: dict[str, int] = field(default_factory=dict)
    times_s: list[float] = field(default_factory=list)
    python_calls: int = 0  # function calls (Python and builtin) of one step, counted by cProfile
    optimizer_calls: int = 0  # those of the optimizer's step alone (0: no optimizer step)


def load_factory(path: str) -> StepFactory:
    """Import a ``"package.module:function"`` factory path.

    Example:
        >>> load_factory("bench.baselines.megatron:build_megatron_step").__name__
        'build_megatron_step'
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"load_factory: expected 'package.module:function', got {path!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise TypeError(f"load_factory: {path!r} is a {type(factory).__name__}, not a callable")
    return cast(StepFactory, factory)


def _all_ranks_ok(ok: bool, ctx: TPContext) -> bool:
    flags: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(flags, ok, group=ctx.group)
    return all(flags)


def _short_error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check_parity(
    step: TrainStep,
    result: ImplResult,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]] | None,
    job: BenchJob,
) -> None:
    """One counted step; on rank 0 compare its loss and gathered gradients to the reference."""
    step.zero_grad()
    with CollectiveCounter() as forward_counter:
        loss = step.forward_loss(tokens, targets)
    with CollectiveCounter() as backward_counter:
        torch.autograd.backward(loss)
    result.comm_forward = dict(forward_counter.counts)
    result.comm_backward = dict(backward_counter.counts)
    grads = step.full_grads()
    result.loss = float(loss.detach())
    if reference is None:
        return
    ref_loss, ref_grads = reference
    if set(grads) != set(ref_grads):
        raise ValueError(
            f"full_grads() keys differ from the reference: missing "
            f"{sorted(set(ref_grads) - set(grads))}, unexpected {sorted(set(grads) - set(ref_grads))}"
        )
    result.loss_abs_diff = abs(result.loss - float(ref_loss))
    ok = math.isclose(result.loss, float(ref_loss), rel_tol=job.rtol, abs_tol=job.atol)
    worst = 0.0
    for name, ref in ref_grads.items():
        got = grads[name].detach()
        if got.shape != ref.shape:
            raise ValueError(
                f"gradient {name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )
        worst = max(worst, float((got - ref).abs().max()))
        # Relative to the gradient's scale: reordered sums differ between CPUs' kernels.
        atol = max(job.atol, job.rtol * float(ref.abs().max()) if ref.numel() else 0.0)
        ok = ok and torch.allclose(got, ref, rtol=job.rtol, atol=atol)
    result.grad_max_abs_diff = worst
    result.parity_ok = ok


def _bench_config(
    cfg: LlamaConfig, job: BenchJob, ctx: TPContext, factories: Mapping[str, StepFactory]
) -> dict[str, ImplResult]:
    full_weights = make_full_weights(cfg, job.seed)
    tokens, targets = make_batch(cfg, job.seed)
    reference = loss_and_grads(cfg, full_weights, tokens, targets) if ctx.rank == 0 else None
    results = {name: ImplResult() for name in factories}
    steps: dict[str, TrainStep] = {}
    for name, factory in factories.items():
        # each phase ends with an agreement, so a failure on one rank drops the implementation
        # on all ranks instead of leaving the others waiting in a collective
        result = results[name]
        step: TrainStep | None = None
        try:
            step = factory(cfg, full_weights, ctx)
        except Exception as exc:
            result.status, result.error = "error", f"building it: {_short_error(exc)}"
        if _all_ranks_ok(step is not None, ctx) and step is not None:
            try:
                _check_parity(step, result, tokens, targets, reference, job)
            except Exception as exc:
                result.status, result.error = "error", f"first step: {_short_error(exc)}"
            if _all_ranks_ok(result.status == "ok", ctx):
                steps[name] = step
        if name not in steps and result.status == "ok":
            result.status, result.error = "error", "failed on another rank"

    # after the parity step, so every implementation is checked on the same weights; a first
    # optimizer step on the parity step's gradients, agreed on by every rank, drops an
    # implementation whose optimizer fails instead of failing the run
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name in list(steps) if job.optimizer else []:
        try:
            optimizers[name] = _optimizer(steps[name])
            optimizers[name].step()
        except Exception as exc:
            results[name].status, results[name].error = "error", f"optimizer: {_short_error(exc)}"
        if not _all_ranks_ok(results[name].status == "ok", ctx):
            del steps[name]
            optimizers.pop(name, None)
            if results[name].status == "ok":
                results[name].status, results[name].error = "error", "failed on another rank"
    names = list(steps)
    for it in range(job.warmup + job.iters):
        # rotate the order every iteration so no implementation always runs first after a barrier
        shift = it % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            dist.barrier(group=ctx.group)
            start = time.perf_counter()
            step.zero_grad()
            torch.autograd.backward(step.forward_loss(tokens, targets))
            if optimizers:
                optimizers[name].step()
            elapsed = time.perf_counter() - start
            if it >= job.warmup:
                results[name].times_s.append(elapsed)
    for name in names:  # one more step each, profiled (untimed): its function-call count
        step = steps[name]
        dist.barrier(group=ctx.group)
        step.zero_grad()
        profile = cProfile.Profile()
        profile.enable()
        torch.autograd.backward(step.forward_loss(tokens, targets))
        profile.disable()
        results[name].python_calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        if optimizers:
            profile = cProfile.Profile()
            profile.enable()
            optimizers[name].step()
            profile.disable()
            results[name].optimizer_calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    return results


def _optimizer(step: TrainStep) -> torch.optim.Optimizer:
    """AdamW with foreach kernels over the step's parameters, one group per tensor type.

    torch's DTensor refuses a foreach list that mixes DTensors and plain tensors (the
    torch TP baseline leaves its norms plain); a group per type keeps every list uniform.
    """
    groups: dict[type, list[torch.Tensor]] = {}
    for param in step.parameters():
        groups.setdefault(type(param), []).append(param)
    return torch.optim.AdamW(
        [{"params": params} for params in groups.values()], lr=1e-4, foreach=True
    )


def run_bench_rank(job: BenchJob) -> list[dict[str, dict[str, Any]]]:
    """The body each rank runs (process group already initialised): per config, per
    implementation, this rank's ``ImplResult`` as a dict. Collective.

    Example:
        >>> run_distributed(run_bench_rank, 2, args=(job,), timeout_s=300)  # doctest: +SKIP
    """
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("run_bench_rank: the default process group is not initialised")
    ctx = TPContext(
        rank=rank,
        world_size=world_size,
        group=group,
        torch_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
    )
    factories = {name: load_factory(path) for name, path in job.implementations.items()}
    out: list[dict[str, dict[str, Any]]] = []
    for cfg in job.configs:
        results = _bench_config(cfg, job, ctx, factories)
        out.append({name: asdict(result) for name, result in results.items()})
    return out

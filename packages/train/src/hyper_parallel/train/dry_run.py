"""``hp-train --dry-run``: every rank's plan and memory from the job alone, on a fake process group.

No process is started: this process plays each rank of the configured world in turn through
torch's fake process group (``torch.testing._internal.distributed.fake_pg``: collectives
return at once), builds the model on the meta device and applies the same
``parallelize``/``pipeline`` the run would, then counts this rank's local bytes. One
microbatch step on rank 0 (when its shards fit in host memory) counts the collectives.
"""

from __future__ import annotations

import gc
import heapq
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import get_spec
from hyper_parallel.dmodule.models.training import train_step
from hyper_parallel.dtensor import DTensor, FallbackWarning, collectives
from hyper_parallel.train.config import JobConfig, batch_layout
from hyper_parallel.train.tokenizer import build_tokenizer
from hyper_parallel.train.trainer import build_model_config, model_job_config, parallel_dims

__all__ = ["RankMemory", "dry_run", "format_report"]

GIB = 2**30
#: Rank 0's collectives are counted by running one step when its shards need less than this.
TRACE_LIMIT_BYTES = 2 * GIB


@dataclass
class RankMemory:
    """One rank's bytes: parameters, gradients, AdamW's two moments, activations of a microbatch."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int | None
    largest: list[tuple[int, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Everything above (activations counted once: one microbatch in flight)."""
        return self.params + self.grads + self.optimizer + (self.activations or 0)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def activation_bytes(model_config: Any, job: JobConfig, local_batch: int) -> int | None:
    """A per-microbatch estimate of a transformer's saved activations on one rank (or None).

    Korthikanti et al. (2022), per layer, 2-byte values: ``s b h (10 + 24/t + 5 a s / (h t))``
    with tensor parallelism ``t``, doubled for float32; full activation checkpointing keeps
    each block's input only, plus one block's worth during its recompute; plus the logits.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> activation_bytes(Llama.Config(), JobConfig(), 8) > 0
        True
    """
    try:
        h, a, layers = model_config.dim, model_config.n_heads, model_config.n_layers
        vocab = model_config.vocab_size
    except AttributeError:
        return None
    s, b, t = job.training.seq_len, local_batch, job.parallelism.tp
    pp = job.parallelism.pp
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * 2  # float32: twice 16-bit
    layers_here = -(-layers // pp)
    if job.parallelism.activation_checkpoint == "full":
        blocks = layers_here * s * b * h * 4 + per_layer
    else:
        blocks = layers_here * per_layer
    logits = s * b * vocab * 4 * 2 / t  # the logits and their softmax
    return int(blocks + logits)


def _plan_rank(job: JobConfig, model_config: Any, world: int) -> tuple[list[torch.nn.Module], Any]:
    spec = get_spec(job.model.name)
    dims = parallel_dims(job, world)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = model_config.build()
    if job.parallelism.pp > 1:
        assert spec.pipelining_fn is not None
        pipe = spec.pipelining_fn(model, dims, model_job_config(job))
        return list(pipe.model_parts), pipe
    if spec.parallelize_fn is not None and (dims.tp_enabled or dims.fsdp_enabled):
        model = spec.parallelize_fn(model, dims, model_job_config(job))
    return [model], model


def _count_collectives(
    job: JobConfig, model: torch.nn.Module, local_batch: int, accumulation: int
) -> Counter[str]:
    model.to_empty(device="cpu")
    torch.manual_seed(job.training.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        model.init_weights()  # type: ignore[operator]
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.optimizer.lr, foreach=False)
    tokens = torch.zeros(local_batch, job.training.seq_len, dtype=torch.long)
    counts: Counter[str] = Counter()

    def record(entry: collectives.CollectiveRecord) -> None:
        counts[entry.kind] += 1

    with collectives.observe_collectives(record):
        train_step(
            model,
            [(tokens, tokens)] * accumulation,
            optimizer,
            max_norm=job.training.max_norm,
            skip_nonfinite=True,
        )
    return counts


def dry_run(
    job: JobConfig, *, allow_imports: tuple[str, ...] = ()
) -> tuple[list[RankMemory], Counter[str] | None]:
    """Each rank's memory and rank 0's collectives per step, without starting a process.

    Example::

        >>> ranks, counts = dry_run(JobConfig().apply_overrides(["parallelism.tp=2"]))  # doctest: +SKIP
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("--dry-run plays every rank itself: run it outside a process group")
    if job.parallelism.dp_shard == -1:
        raise ConfigError(
            "expected a number of ranks: resolve -1 (the rest of the world) first "
            "(resolve_world(job, world_size); hp-train --dry-run --world-size N)",
            path="parallelism.dp_shard",
        )
    tokenizer = build_tokenizer(job.tokenizer.path)
    model_config = build_model_config(job, tokenizer.vocab_size, allow_imports)
    local_batch, accumulation = batch_layout(job)
    world = job.parallelism.world_size
    activations = activation_bytes(model_config, job, local_batch)
    ranks: list[RankMemory] = []
    counts: Counter[str] | None = None
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            parts, runnable = _plan_rank(job, model_config, world)
            named = [(n, p) for part in parts for n, p in part.named_parameters()]
            params = sum(_local_bytes(p) for _, p in named)
            largest = heapq.nlargest(3, ((_local_bytes(p), n) for n, p in named))
            ranks.append(RankMemory(rank, params, params, 2 * params, activations, largest))
            if rank == 0 and job.parallelism.pp == 1 and params * 4 < TRACE_LIMIT_BYTES:
                counts = _count_collectives(job, runnable, local_batch, accumulation)
            del parts, runnable, named
        finally:
            # this rank's meshes must be gone before the next rank builds its own
            gc.collect()
            dist.destroy_process_group()
    return ranks, counts


def format_report(job: JobConfig, ranks: list[RankMemory], counts: Counter[str] | None) -> str:
    """The dry run's table: per-rank bytes, the activation estimate, rank 0's collectives."""
    par = job.parallelism
    lines = [
        f"dry run: {job.model.name} ({job.model.flavor}) on {par.world_size} ranks "
        f"(dp_replicate={par.dp_replicate} dp_shard={par.dp_shard} tp={par.tp} pp={par.pp}); "
        "no process started",
        f"  {'rank':>4}  {'params':>10}  {'grads':>10}  {'AdamW':>10}  {'activations':>12}  "
        f"{'total':>10}",
    ]
    for r in ranks:
        act = "n/a" if r.activations is None else _gib(r.activations)
        lines.append(
            f"  {r.rank:>4}  {_gib(r.params):>10}  {_gib(r.grads):>10}  {_gib(r.optimizer):>10}  "
            f"{act:>12}  {_gib(r.total):>10}"
        )
    lines.append("  (activations: an estimate for one microbatch in flight)")
    if counts is None:
        lines.append("collectives per step: not traced (pipeline, or rank 0's shards too large)")
    else:
        listed = ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())) or "none"
        lines.append(f"collectives per step (rank 0): {listed}")
    return "\n".join(lines)


def check_memory(ranks: list[RankMemory], limit_gib: float) -> None:
    """Refuse a layout whose busiest rank exceeds ``limit_gib``, naming its largest consumers."""
    worst = max(ranks, key=lambda r: r.total)
    if worst.total <= limit_gib * GIB:
        return
    consumers = [
        f"optimizer state {_gib(worst.optimizer)}",
        f"gradients {_gib(worst.grads)}",
        f"parameters {_gib(worst.params)}",
    ]
    if worst.activations:
        consumers.insert(0, f"activations {_gib(worst.activations)}")
    tensors = ", ".join(f"{name} ({_gib(size)} params)" for size, name in worst.largest)
    raise ConfigError(
        f"rank {worst.rank} needs {_gib(worst.total)}, over --dry-run-memory {limit_gib:g} GiB: "
        f"{'; '.join(consumers)}; largest tensors: {tensors}. Raise tp/dp_shard/pp, "
        "or use activation checkpointing",
        path="parallelism",
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB / 1000 else f"{nbytes / 2**20:.2f} MiB"

"""The dry run's report: one row per role, its JSON, and the memory budget's refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.config import ConfigError
from hyper_parallel.train.config import JobConfig

__all__ = ["GIB", "DryRunReport", "RoleReport", "check_memory", "format_report"]

GIB = 2**30


@dataclass
class RoleReport:
    """The ranks that hold the same bytes, and those bytes (one microbatch's activations)."""

    ranks: list[int]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    total_bytes: int
    #: the largest parameter shards and saved activations: ``(bytes, name)``
    largest: list[tuple[int, str]]
    stage: int = 0
    #: microbatches whose activations a stage holds at once under the schedule
    microbatches_in_flight: int = 1
    #: the largest FSDP group unsharded (forward and backward prefetch) and its gradients
    fsdp_unsharded_bytes: int = 0
    #: the logits' gradient (last stage) or the activation sent on (other stages)
    output_bytes: int = 0
    #: mesh axis -> bytes this rank's collectives send in one microbatch's forward (FSDP's
    #: all-gathers, TP/SP/CP/EP exchanges; a backward moves about as much again)
    forward_collective_bytes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The role as plain JSON values."""
        return {
            "ranks": self.ranks,
            "stage": self.stage,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "microbatches_in_flight": self.microbatches_in_flight,
            "fsdp_unsharded_bytes": self.fsdp_unsharded_bytes,
            "output_bytes": self.output_bytes,
            "forward_collective_bytes": self.forward_collective_bytes,
            "total_bytes": self.total_bytes,
            "largest": [[size, name] for size, name in self.largest],
        }


@dataclass
class DryRunReport:
    """Every role of a job's world; the roles cover every rank exactly once."""

    world_size: int
    roles: list[RoleReport]
    model: str = ""
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def max_total_bytes(self) -> int:
        """The busiest role's total."""
        return max(r.total_bytes for r in self.roles)

    def to_json(self) -> dict[str, Any]:
        """``{"world_size", "model", "layout", "roles": [...], "max_total_bytes"}``."""
        return {
            "world_size": self.world_size,
            "model": self.model,
            "layout": self.layout,
            "roles": [r.to_json() for r in self.roles],
            "max_total_bytes": self.max_total_bytes,
        }


def _ranks_text(ranks: list[int]) -> str:
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(spans)


def format_report(job: JobConfig, report: DryRunReport) -> str:
    """The dry run's table: one row per role, with the ranks it covers.

    Example::

        print(format_report(job, dry_run(job, 8)))
    """
    par = job.parallelism
    lay = report.layout
    lines = [
        f"dry run: {report.model} on {report.world_size} ranks "
        f"(dp_replicate={par.dp_replicate} dp_shard={lay['dp_shard']} cp={par.cp} tp={par.tp} "
        f"pp={par.pp} ep={par.ep} etp={par.etp}; activation_checkpoint={par.activation_checkpoint}, "
        f"microbatch {lay['microbatch']} x seq {job.training.seq_len}); no process started, "
        f"nothing allocated",
        f"  {'stage':>5}  {'params':>10}  {'grads':>10}  {'AdamW':>10}  {'activations':>12}  "
        f"{'in flight':>9}  {'FSDP+out':>10}  {'total':>10}  ranks",
    ]
    for r in report.roles:
        lines.append(
            f"  {r.stage:>5}  {_gib(r.params_bytes):>10}  {_gib(r.grads_bytes):>10}  "
            f"{_gib(r.optimizer_bytes):>10}  {_gib(r.activations_bytes):>12}  "
            f"{r.microbatches_in_flight:>9}  {_gib(r.fsdp_unsharded_bytes + r.output_bytes):>10}  "
            f"{_gib(r.total_bytes):>10}  {_ranks_text(r.ranks)}"
        )
    lines.append(
        f"  busiest: {_gib(report.max_total_bytes)} (activations measured on fake tensors for one "
        "microbatch; not counted: allocator fragmentation, communication buffers, CUDA context)"
    )
    return "\n".join(lines)


def check_memory(report: DryRunReport, limit_gib: float) -> None:
    """Refuse a layout whose busiest role exceeds ``limit_gib``, naming it and its largest tensors.

    Example::

        check_memory(dry_run(job, 8), 80.0)   # ConfigError naming the role over 80 GiB
    """
    worst = max(report.roles, key=lambda r: r.total_bytes)
    if worst.total_bytes <= limit_gib * GIB:
        return
    consumers = [
        f"activations {_gib(worst.activations_bytes)} x {worst.microbatches_in_flight} in flight",
        f"optimizer state {_gib(worst.optimizer_bytes)}",
        f"gradients {_gib(worst.grads_bytes)}",
        f"parameters {_gib(worst.params_bytes)}",
        f"FSDP unsharded groups {_gib(worst.fsdp_unsharded_bytes)}",
    ]
    tensors = ", ".join(f"{name} ({_gib(size)})" for size, name in worst.largest)
    raise ConfigError(
        f"stage {worst.stage} (ranks {_ranks_text(worst.ranks)}) needs {_gib(worst.total_bytes)}, "
        f"over --dry-run-memory {limit_gib:g} GiB: {'; '.join(consumers)}; largest tensors: "
        f"{tensors}. Raise tp/dp_shard/pp, or use activation checkpointing",
        path="parallelism",
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB / 1000 else f"{nbytes / 2**20:.2f} MiB"

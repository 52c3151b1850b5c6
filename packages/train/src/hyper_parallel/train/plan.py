"""``hp-train --plan``: search the layouts of a job's world, measure each with the dry run, rank them.

The search space: every ``dp_replicate x dp_shard x cp x tp x pp`` factoring of the world
the job's model and batch allow (``tp`` dividing the head counts, ``cp`` only for a model
with context-parallel attention, ``pp`` up to the layers, ``dp`` dividing the global
batch), ``ep`` (dividing the experts, for a model with routed experts) and ``etp``
(1 or ``tp``), activation checkpointing (none, selective, full), and the batch's split:
gradient accumulation without a pipeline, 1F1B or GPipe with some microbatch counts with
one. ``tp``, ``etp`` and ``cp`` stay inside a node unless no such layout fits.

Memory comes from the dry run alone (the planner has no memory model of its own): the
layouts are measured in the order of their estimated step time
(:mod:`~hyper_parallel.train.plan_cost`), fastest first, until ``top`` of them fit.
Unmeasured, a layout is ruled out when what the dry run measured of layouts it shares
parts with already exceeds the budget: the parameters, gradients and optimizer states of
its weight shards (the same ``dp_shard x cp``, over which FSDP shards, ``tp``, ``pp``,
``ep`` and ``etp``; ``dp_replicate`` copies them) plus a microbatch's activations (the
same layout but for ``dp_replicate`` and ``dp_shard``), a rank holding both. So is a
layout estimated as fast as a simpler one that fits (it cannot rank above it). When
nothing fits, the degrees that needed the least are measured once more with their least
activations (full checkpointing, the most microbatches), so that the smallest need
reported is a fair one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.config import ConfigError
from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.plan_cost import Layout, ModelFacts, StepEstimate, estimate_step
from hyper_parallel.train.plan_devices import Device

__all__ = [
    "Candidate",
    "Measured",
    "NoLayoutError",
    "PlanRequest",
    "PlanResult",
    "dry_run_memory",
    "enumerate_layouts",
    "plan",
]

GIB = 2**30
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
PIPELINE_SCHEDULES: tuple[str, ...] = ("1F1B", "GPipe")


class NoLayoutError(ConfigError):
    """No factoring of the world suits the job's model and batch."""


@dataclass(frozen=True)
class PlanRequest:
    """The cluster a plan is for: its ranks, each one's memory, the device, ranks per node.

    Example::

        >>> from hyper_parallel.train.plan_devices import DEVICES
        >>> PlanRequest(8, 80.0, DEVICES["h100"]).budget_bytes == 80 * 2**30
        True
    """

    world_size: int
    device_memory_gib: float
    device: Device
    #: ranks per node (default: the device's)
    gpus_per_node: int = 0
    #: stop once this many layouts fit (the best ``top``, ranked)
    top: int = 3

    @property
    def budget_bytes(self) -> int:
        """The memory each rank may use."""
        return int(self.device_memory_gib * GIB)

    @property
    def node(self) -> int:
        """Ranks per node."""
        return self.gpus_per_node or self.device.gpus_per_node


@dataclass(frozen=True)
class Measured:
    """The dry run of one layout: its busiest rank's bytes, its largest states, those ranks."""

    max_total_bytes: int
    #: the largest parameters + gradients + optimizer states of any role
    max_states_bytes: int
    busiest_ranks: tuple[int, ...]
    #: the least activations of any role (one microbatch's saved bytes and recompute)
    min_activations_bytes: int = 0


#: ``(job, world_size) -> Measured``: the dry run of a layout (see :func:`dry_run_memory`).
MemoryFn = Callable[[JobConfig, int], Measured]


@dataclass
class Candidate:
    """One layout of the plan: its estimate and, once measured, its memory."""

    layout: Layout
    estimate: StepEstimate
    #: tp, etp and cp inside a node
    inside_node: bool
    measured: Measured | None = None
    fits: bool = False

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` record of this candidate."""
        m, e = self.measured, self.estimate
        return {
            "parallelism": self.layout.degrees(),
            "activation_checkpoint": self.layout.activation_checkpoint,
            "pipeline_schedule": self.layout.pipeline_schedule if self.layout.pp > 1 else None,
            "pipeline_microbatches": self.layout.pipeline_microbatches,
            "local_batch_size": self.layout.local_batch_size,
            "gradient_accumulation_steps": self.layout.gradient_accumulation_steps,
            "max_total_bytes": None if m is None else m.max_total_bytes,
            "busiest_ranks": None if m is None else list(m.busiest_ranks),
            "fits": self.fits,
            "estimated_step_seconds": e.seconds,
            "tokens_per_second": e.tokens_per_second,
            "mfu": e.mfu,
            "compute_seconds": e.compute_seconds,
            "exposed_comm_seconds": dict(e.comm_seconds),
            "pipeline_bubble": e.bubble,
            "inside_node": self.inside_node,
        }


@dataclass
class PlanResult:
    """The measured candidates, ranked: those that fit by estimated step time (the simpler,
    then the smaller, among equals), then the rest by memory; and how many layouts were considered, measured and ruled out unmeasured."""

    request: PlanRequest
    facts: ModelFacts
    candidates: list[Candidate]
    considered: int
    measured: int
    ruled_out: int
    rejected: Counter[str] = field(default_factory=Counter)

    @property
    def best(self) -> Candidate | None:
        """The fastest layout that fits, or None."""
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    @property
    def smallest(self) -> Candidate | None:
        """The measured layout that needs the least memory per rank."""
        measured = [c for c in self.candidates if c.measured is not None]
        return min(measured, key=_memory, default=None)


def _memory(c: Candidate) -> int:
    assert c.measured is not None
    return c.measured.max_total_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_splits(job: JobConfig, layout_dp: int, pp: int) -> list[tuple[int, int, int]]:
    """``(local batch, accumulation, microbatches)`` options for a data-parallel degree."""
    training = job.training
    per_rank = training.global_batch_size // layout_dp
    if pp == 1:
        if training.local_batch_size is not None:
            local = training.local_batch_size
            return [(local, per_rank // local, 0)] if per_rank % local == 0 else []
        given = training.gradient_accumulation_steps
        options = {(per_rank // given, given, 0)} if per_rank % given == 0 else set()
        options.add((1, per_rank, 0))  # the least activations: one sample per microstep
        return sorted(options, key=lambda o: o[1])
    counts = [m for m in _divisors(per_rank) if m >= pp]
    if not counts:
        return []
    # the fewest microbatches (largest ones), twice as many, and one sample each
    chosen = sorted({counts[0], *(m for m in counts if m == 2 * counts[0]), counts[-1]})
    return [(per_rank, 1, m) for m in chosen]


def _degree_groups(
    job: JobConfig, facts: ModelFacts, world: int, rejected: Counter[str]
) -> Iterator[dict[str, int]]:
    """Every degree assignment the cheap exact facts allow; the reasons for the others."""
    par_batch = job.training.global_batch_size
    seq = job.training.seq_len
    for tp in _divisors(world):
        if facts.n_heads % tp or facts.n_kv_heads % tp:
            rejected[
                f"tp={tp}: n_heads ({facts.n_heads}) and n_kv_heads ({facts.n_kv_heads}) do "
                "not divide by it"
            ] += 1
            continue
        for cp in _divisors(world // tp):
            if cp > 1 and not facts.context_parallel:
                rejected[f"cp={cp}: the model has no context-parallel attention"] += 1
                continue
            if cp > 1 and seq % (2 * cp):
                rejected[f"cp={cp}: training.seq_len ({seq}) does not divide by 2 x cp"] += 1
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > facts.n_layers:
                    rejected[f"pp={pp}: more stages than the model's {facts.n_layers} layers"] += 1
                    continue
                dp = world // (tp * cp * pp)
                if par_batch % dp:
                    rejected[
                        f"dp={dp}: training.global_batch_size ({par_batch}) does not divide by it"
                    ] += 1
                    continue
                for dp_replicate in _divisors(dp):
                    yield from _expert_degrees(
                        facts, dp_replicate, dp // dp_replicate, cp, tp, pp, rejected
                    )


def _expert_degrees(
    facts: ModelFacts,
    dp_replicate: int,
    dp_shard: int,
    cp: int,
    tp: int,
    pp: int,
    rejected: Counter[str],
) -> Iterator[dict[str, int]]:
    base = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
    if not facts.num_experts:
        yield {**base, "ep": 1, "etp": 1}
        return
    for etp in sorted({1, tp}):
        pool = dp_shard * cp * (tp if etp == 1 else 1)
        for ep in _divisors(pool):
            if facts.num_experts % ep:
                rejected[f"ep={ep}: num_experts ({facts.num_experts}) does not divide by it"] += 1
                continue
            yield {**base, "ep": ep, "etp": etp}


def enumerate_layouts(
    job: JobConfig,
    facts: ModelFacts,
    world: int,
    *,
    check: Callable[[JobConfig], None] | None = None,
) -> tuple[list[Layout], Counter[str]]:
    """Every layout of ``world`` ranks for ``job`` and the reasons the others were refused.

    ``check(job)`` (default: the trainer's own ``check_layout`` and model checks) raises
    a ConfigError for a layout the trainer would refuse.

    Example::

        >>> from hyper_parallel.train.plan_cost import model_facts
        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> layouts, _ = enumerate_layouts(JobConfig(), model_facts(Llama.Config(), 64), 2)
        >>> sorted({(l.dp_shard, l.tp, l.cp, l.pp) for l in layouts})[:2]
        [(1, 1, 1, 1), (1, 1, 1, 2)]
    """
    check = check or _trainer_check(job, world)
    layouts: list[Layout] = []
    rejected: Counter[str] = Counter()
    for degrees in _degree_groups(job, facts, world, rejected):
        dp = degrees["dp_replicate"] * degrees["dp_shard"]
        splits = _batch_splits(job, dp, degrees["pp"])
        if not splits:
            rejected[
                f"pp={degrees['pp']}, dp={dp}: the per-rank batch does not split into the "
                "microbatches the schedule needs"
            ] += 1
            continue
        group: list[Layout] = []
        for local, accumulation, microbatches in splits:
            schedules = PIPELINE_SCHEDULES if degrees["pp"] > 1 else ("1F1B",)
            for schedule in schedules:
                for ac in AC_MODES:
                    group.append(
                        Layout(
                            **degrees,
                            activation_checkpoint=ac,
                            pipeline_schedule=schedule,
                            pipeline_microbatches=microbatches,
                            local_batch_size=local,
                            gradient_accumulation_steps=accumulation,
                        )
                    )
        try:
            check(group[0].apply(job))
        except ValueError as error:  # ConfigError too: a layout the model code refuses
            rejected[str(error)] += 1
            continue
        layouts.extend(group)
    return layouts, rejected


def _trainer_check(job: JobConfig, world: int) -> Callable[[JobConfig], None]:
    from hyper_parallel.train.tokenizer import build_tokenizer
    from hyper_parallel.train.trainer import build_model_config, check_layout

    vocab = build_tokenizer(job.tokenizer.path).vocab_size

    def check(candidate: JobConfig) -> None:
        build_model_config(candidate, vocab)  # the model's own rules (cp, ep, aux loss)
        check_layout(candidate, world)

    return check


def _inside_node(layout: Layout, node: int) -> bool:
    span = layout.tp * layout.cp
    return span <= node and node % span == 0


def _lean(group: list[Candidate]) -> Candidate:
    """The candidate of one set of degrees with the least activations: full checkpointing,
    the most microbatches (1F1B: the fewest in flight)."""
    return max(
        group,
        key=lambda g: (
            g.layout.activation_checkpoint == "full",
            g.layout.microbatches,
            g.layout.pipeline_schedule == "1F1B",
        ),
    )


def plan(
    job: JobConfig,
    request: PlanRequest,
    facts: ModelFacts,
    *,
    memory: MemoryFn | None = None,
    check: Callable[[JobConfig], None] | None = None,
) -> PlanResult:
    """The ranked layouts of ``job`` on ``request``'s cluster (see the module docstring).

    ``memory`` measures a layout (default: :func:`dry_run_memory`). Raises
    :class:`NoLayoutError` when no layout of the world suits the model and batch.

    Example::

        result = plan(job, PlanRequest(8, 80.0, DEVICES["h100"]), model_facts(config, 8192))
        result.best.layout.describe()   # 'dp_shard=8, AC none'
    """
    world = request.world_size
    layouts, rejected = enumerate_layouts(job, facts, world, check=check)
    if not layouts:
        reasons = "; ".join(reason for reason, _ in rejected.most_common(6))
        raise NoLayoutError(
            f"expected a world size some layout of {job.model.name!r} "
            f"({job.model.flavor}) can use, found {world}: {reasons}",
            path="--world-size",
        )
    measure = memory or dry_run_memory()
    budget = request.budget_bytes
    candidates = [
        Candidate(
            layout,
            estimate_step(facts, layout, job, request.device, request.node),
            _inside_node(layout, request.node),
        )
        for layout in layouts
    ]
    candidates.sort(key=lambda c: (not c.inside_node, c.estimate.seconds, _complexity(c.layout)))
    groups: dict[tuple[int, ...], list[Candidate]] = {}
    alike: dict[tuple[int, ...], list[Candidate]] = {}  # by weight shards
    for c in candidates:
        groups.setdefault(tuple(c.layout.degrees().values()), []).append(c)
        alike.setdefault(_shards(c.layout), []).append(c)
    # what the dry run said of what layouts share: a rank's states (the same weight shards)
    # and a microbatch's activations (all but the data-parallel degrees alike); a rank's
    # total is at least the sum of the two
    states: dict[tuple[Any, ...], int] = {}
    activations: dict[tuple[Any, ...], int] = {}
    refused: set[tuple[int, ...]] = set()
    ruled_out = 0
    measured: list[Candidate] = []

    def run(c: Candidate) -> None:
        """Measure ``c`` (a layout the dry run refuses rules out its degrees)."""
        try:
            c.measured = measure(c.layout.apply(job), world)
        except ValueError as error:  # ConfigError too: a layout the model code refuses
            rejected[str(error)] += 1
            refused.add(tuple(c.layout.degrees().values()))
            return
        c.fits = c.measured.max_total_bytes <= budget
        measured.append(c)
        states[_shards(c.layout)] = c.measured.max_states_bytes
        activations[_microbatch(c.layout)] = c.measured.min_activations_bytes

    for c in candidates:
        fitting = [f for f in measured if f.fits]
        if fitting and not c.inside_node and any(f.inside_node for f in fitting):
            break  # tp, etp and cp leave a node only when nothing inside one fits
        if sum(f.estimate.seconds <= c.estimate.seconds for f in fitting) >= request.top:
            break
        if tuple(c.layout.degrees().values()) in refused or c.measured is not None:
            continue
        shards, microbatch = _shards(c.layout), _microbatch(c.layout)
        if shards not in states and microbatch not in activations:
            # the states first, from a layout of the same shards whose microbatch the dry
            # run has seen (its activations cached: a cheap run); c's own may not be needed
            probe = next((p for p in alike[shards] if _probe(p, activations, refused)), None)
            if probe is not None:
                run(probe)
        floor = states.get(shards, 0) + activations.get(microbatch, 0)
        if floor > budget:
            ruled_out += 1
            continue
        if any(_tied(f, c) for f in fitting):
            continue  # as fast as a simpler layout that fits: it cannot rank above it
        run(c)
    if not any(c.fits for c in measured) and measured:
        # the least activations of the degrees that needed the least: the fair smallest
        least = min(measured, key=_memory)
        lean = _lean(groups[tuple(least.layout.degrees().values())])
        if lean.measured is None:
            run(lean)
    ranked = sorted(
        measured,
        key=lambda c: (
            not c.fits,
            c.estimate.seconds if c.fits else _memory(c),
            _complexity(c.layout) if c.fits else (0, 0),
            _memory(c),
        ),
    )
    return PlanResult(request, facts, ranked, len(layouts), len(measured), ruled_out, rejected)


def _probe(
    c: Candidate, activations: dict[tuple[Any, ...], int], refused: set[tuple[int, ...]]
) -> bool:
    """``c`` is unmeasured, its microbatch measured, its degrees not refused."""
    return (
        c.measured is None
        and _microbatch(c.layout) in activations
        and tuple(c.layout.degrees().values()) not in refused
    )


def _tied(fits: Candidate, other: Candidate) -> bool:
    """``other`` is estimated as fast as ``fits`` and is no simpler."""
    a, b = fits.estimate.seconds, other.estimate.seconds
    return abs(a - b) <= 1e-9 * max(a, b) and _complexity(fits.layout) <= _complexity(other.layout)


def _shards(layout: Layout) -> tuple[int, ...]:
    """What decides a rank's weights, gradients and optimizer states: the same key, the
    same bytes (FSDP shards over ``dp_shard x cp`` flattened; ``dp_replicate`` copies)."""
    return layout.dp_shard * layout.cp, layout.tp, layout.pp, layout.ep, layout.etp


def _microbatch(layout: Layout) -> tuple[Any, ...]:
    """What decides a microbatch's activations: the layout but its data-parallel degrees."""
    return (
        layout.cp,
        layout.tp,
        layout.pp,
        layout.ep,
        layout.etp,
        layout.activation_checkpoint,
        layout.pipeline_schedule,
        layout.pipeline_microbatches,
        layout.local_batch_size,
    )


def _complexity(layout: Layout) -> tuple[int, int]:
    """Fewer parallel axes, then less checkpointing, first among equals."""
    axes = sum(v > 1 for v in layout.degrees().values())
    return axes, AC_MODES.index(layout.activation_checkpoint)


def dry_run_memory() -> MemoryFn:
    """The dry run as the planner's memory: one cache for every layout of a plan.

    Example::

        measure = dry_run_memory()
        measure(job, 8).max_total_bytes
    """
    from hyper_parallel.train.dry_run import DryRunCache, dry_run

    cache = DryRunCache()

    def measure(job: JobConfig, world: int) -> Measured:
        report = dry_run(job, world, cache=cache)
        busiest = max(report.roles, key=lambda r: r.total_bytes)
        states = max(r.params_bytes + r.grads_bytes + r.optimizer_bytes for r in report.roles)
        least = min(r.activations_bytes for r in report.roles)
        return Measured(report.max_total_bytes, states, tuple(busiest.ranks), least)

    return measure

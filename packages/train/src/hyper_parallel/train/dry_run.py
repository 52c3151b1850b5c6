"""``hp-train --dry-run``: each role's memory from the job alone, one simulated rank per role.

No process starts and nothing real is allocated or computed. One rank of the world
without its ``pp`` axis (ranks of every stage shard the same way) builds the model with
one block of each kind on the meta device, through torch's fake process group, and
applies the job's own ``parallelize`` (TP, SP, CP, EP, activation checkpointing, FSDP).
From its parameters' DTensor layouts every rank's exact local bytes follow (uneven shards
included); the stages' blocks come from the pipeline's even split. One microbatch's forward
over fake tensors (:mod:`hyper_parallel.train.saved_tensors`) measures what each block, the
embedding and the head save for backward; a stage's activations are its blocks' sum. Ranks
whose bytes agree form one role: the report has one row per role.
"""

from __future__ import annotations

import inspect
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dmodule import get_spec
from hyper_parallel.dmodule.pipeline import even_starts
from hyper_parallel.dtensor import DTensor, FallbackWarning, Placement, Replicate, Shard
from hyper_parallel.dtensor.fsdp import FSDPModule
from hyper_parallel.dtensor.placement_types import _StridedShard
from hyper_parallel.train.config import JobConfig, batch_layout
from hyper_parallel.train.dry_run_report import (
    DryRunReport,
    RoleReport,
    check_memory,
    format_report,
)
from hyper_parallel.train.saved_tensors import count_activations, fake_world
from hyper_parallel.train.tokenizer import build_tokenizer
from hyper_parallel.train.trainer import (
    autocast_dtype,
    build_model_config,
    check_layout,
    mixed_precision_policy,
    model_job_config,
    parallel_dims,
    resolve_world,
)

__all__ = ["DryRunCache", "DryRunReport", "RoleReport", "check_memory", "dry_run", "format_report"]

#: Mesh axes FSDP shards over: what an unsharded parameter gathers.
_FSDP_AXES = frozenset({"fsdp", "dp_shard", "dp_replicate", "efsdp", "dp_shard_cp", "dp"})
#: Schedules that run every microbatch's forward before any backward.
_ALL_FORWARD_FIRST = frozenset({"gpipe", "loopedbfs"})


@dataclass
class _Pieces:
    """One sub-layout's measurements: per piece (``first``, ``last``, a block kind) of the model."""

    #: per sub-rank: piece -> (bytes, parameter tensors)
    rank_bytes: list[dict[str, tuple[int, int]]]
    #: piece -> unsharded bytes of its largest FSDP group (params in param_dtype, grads)
    fsdp_groups: dict[str, tuple[int, int]]
    #: piece -> its FSDP groups' unsharded gradients, all of them (a pipeline accumulates them)
    fsdp_grads: dict[str, int]
    #: piece -> its largest parameter shards on rank 0: ``(bytes, name)``
    largest_params: dict[str, list[tuple[int, str]]]


@dataclass
class _Activations:
    """One microbatch: saved bytes per piece, recompute per kind, the head's output."""

    pieces: dict[str, int]
    recompute: dict[str, int]
    boundary: int
    logits: int
    #: piece -> its largest saved activations: ``(bytes, description)``
    largest: dict[str, list[tuple[int, str]]]
    #: piece -> mesh axis -> bytes its forward collectives send in
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class DryRunCache:
    """Measurements kept across dry runs of the same model: the planner's many layouts.

    Parameter tables are keyed by the model and every degree but ``pp``; activations by
    what they depend on (the model, sequence, microbatch, tp/cp/ep/etp, checkpointing,
    compute dtype), not by ``dp_shard``, ``dp_replicate`` or ``pp``.
    """

    pieces: dict[tuple[Any, ...], _Pieces] = field(default_factory=dict)
    activations: dict[tuple[Any, ...], _Activations] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0


def dry_run(
    job: JobConfig,
    world_size: int,
    *,
    cache: DryRunCache | None = None,
    allow_imports: tuple[str, ...] = (),
    packed: bool = False,
) -> DryRunReport:
    """Every role's memory for ``job`` on ``world_size`` ranks, without starting a process.

    ``packed``: each microbatch row holds two documents (attention masked at the boundary).

    Example::

        report = dry_run(JobConfig().apply_overrides(["parallelism.tp=2"]), 2)
        report.roles[0].ranks, report.max_total_bytes   # ([0, 1], ...)
    """
    if dist.is_initialized():
        raise RuntimeError("--dry-run plays its ranks itself: run it outside a process group")
    job = resolve_world(job, world_size)
    check_layout(job, world_size)
    tokenizer = build_tokenizer(job.tokenizer.path)
    config = build_model_config(job, tokenizer.vocab_size, allow_imports)
    cache = cache if cache is not None else DryRunCache()
    par = job.parallelism
    sub_job = job.replace(parallelism=replace(par, pp=1, pipeline_microbatches=0))
    sub_world = world_size // par.pp
    local_batch, _ = batch_layout(job)
    n_microbatches = (par.pipeline_microbatches or par.pp) if par.pp > 1 else 1
    microbatch = local_batch // n_microbatches
    spec = get_spec(job.model.name)
    split = spec.pipeline_split
    layers_attr = split.layers if split is not None else "layers"
    first_names = tuple(split.first) if split is not None else ()
    n_layers = int(getattr(config, "n_layers", 0))
    kinds = [_layer_kind(config, j) for j in range(n_layers)]
    reduced = _reduced_config(config, kinds)
    config_key = repr(sorted(config.to_dict().items()))
    pieces_key = (job.model.name, config_key, *_degrees(sub_job), _mp_key(job))
    acts_key = (
        job.model.name,
        config_key,
        job.training.seq_len,
        microbatch,
        packed,
        par.tp,
        par.cp,
        par.ep,
        par.etp,
        par.activation_checkpoint,
        _mp_key(job),
        str(autocast_dtype(job)),
    )
    pieces = cache.pieces.get(pieces_key)
    acts = cache.activations.get(acts_key)
    if pieces is None or acts is None:
        cache.misses += 1
        measured_pieces, measured_acts = _simulate(
            sub_job,
            sub_world,
            reduced,
            layers_attr,
            first_names,
            [_layer_kind(reduced, j) for j in range(int(getattr(reduced, "n_layers", 0)))],
            microbatch,
            packed,
            measure=acts is None,
        )
        pieces = pieces or measured_pieces
        acts = acts or measured_acts
        cache.pieces[pieces_key] = pieces
        assert acts is not None
        cache.activations[acts_key] = acts
    else:
        cache.hits += 1
    roles = _roles(job, world_size, sub_world, pieces, acts, kinds, n_microbatches)
    layout = {
        k: getattr(par, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")
    }
    layout["activation_checkpoint"] = par.activation_checkpoint
    layout["pipeline_microbatches"] = n_microbatches
    layout["microbatch"] = microbatch
    return DryRunReport(
        world_size, roles, model=f"{job.model.name} ({job.model.flavor})", layout=layout
    )


def _degrees(job: JobConfig) -> tuple[object, ...]:
    p = job.parallelism
    return (p.dp_replicate, p.dp_shard, p.cp, p.tp, p.ep, p.etp)


def _mp_key(job: JobConfig) -> str:
    policy = mixed_precision_policy(job)
    return "none" if policy is None else f"{policy.param_dtype}/{policy.reduce_dtype}"


def _layer_kind(config: Any, layer: int) -> str:
    is_moe = getattr(config, "is_moe_layer", None)
    if callable(is_moe):
        return "moe block" if is_moe(layer) else "dense block"
    return "block"


def _reduced_config(config: Any, kinds: list[str]) -> Any:
    """The config with the fewest leading blocks that hold one block of every kind."""
    if not kinds:
        return config
    needed = max(kinds.index(k) for k in set(kinds)) + 1
    changes: dict[str, Any] = {"n_layers": needed}
    only = getattr(config, "mlp_only_layers", None)
    if only is not None:
        changes["mlp_only_layers"] = type(only)(i for i in only if i < needed)
    return config.replace(**changes)


# -- one simulated rank ----------------------------------------------------------------------
def _simulate(
    job: JobConfig,
    world: int,
    config: Any,
    layers_attr: str,
    first_names: tuple[str, ...],
    kinds: list[str],
    microbatch: int,
    packed: bool,
    *,
    measure: bool,
) -> tuple[_Pieces, _Activations | None]:
    """Rank 0 of the pp-less world: its model, every rank's bytes, one microbatch's activations."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dims = parallel_dims(job, world)
        dims.build_mesh("cpu")
        spec = get_spec(job.model.name)
        with torch.device("meta"):
            model = config.build()
        if spec.parallelize_fn is not None and (dims.tp_enabled or dims.fsdp_enabled):
            model = spec.parallelize_fn(model, dims, model_job_config(job))
        piece_of = _piece_namer(layers_attr, first_names, kinds)
        pieces = _piece_bytes(model, piece_of, world, job)
        acts = None
        if measure:
            acts = _measure(model, job, layers_attr, kinds, microbatch, packed)
        return pieces, acts
    finally:
        dist.destroy_process_group()


def _piece_namer(layers_attr: str, first_names: tuple[str, ...], kinds: list[str]) -> Any:
    prefix = f"{layers_attr}."

    def piece_of(name: str) -> str:
        if name.startswith(prefix):
            return kinds[int(name[len(prefix) :].split(".")[0])]
        return "first" if name.split(".")[0] in first_names else "last"

    return piece_of


def _coordinate(mesh_ranks: torch.Tensor, rank: int) -> list[int]:
    """``rank``'s coordinate on a mesh laid out as a regular (row-major) slice of the world."""
    base = int(mesh_ranks.reshape(-1)[0])
    coordinate: list[int] = []
    for axis, size in enumerate(mesh_ranks.shape):
        if size == 1:
            coordinate.append(0)
            continue
        step = int(mesh_ranks.select(axis, 1).reshape(-1)[0] - base)
        coordinate.append(rank // step % size)
    return coordinate


def _chunk(size: int, n: int, index: int) -> int:
    """The length of ``torch.chunk``'s piece ``index`` of ``size`` in ``n`` (0 past the end)."""
    full = -(-size // n)
    return max(0, min(full, size - full * index))


def local_shape(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: list[Placement],
) -> list[int]:
    """The local shard's shape at ``coordinate``: hp-dtensor's layout rule, sizes only.

    Mesh axes apply in order, each to what the earlier ones left: ``Shard`` takes its
    ``torch.chunk`` piece, ``_StridedShard(sf)`` its piece of each of ``sf`` chunks.

    Example::

        >>> local_shape((5, 4), (2,), [1], [Shard(0)])
        [2, 4]
    """
    local = list(shape)
    for axis, p in enumerate(placements):
        n, index = mesh_shape[axis], coordinate[axis]
        if isinstance(p, _StridedShard):
            length = local[p.dim]
            local[p.dim] = sum(
                _chunk(_chunk(length, p.split_factor, j), n, index) for j in range(p.split_factor)
            )
        elif isinstance(p, Shard):
            local[p.dim] = _chunk(local[p.dim], n, index)
    return local


def _local_numel(p: torch.Tensor, rank: int, *, unsharded: bool = False) -> int:
    if not isinstance(p, DTensor):
        return p.numel()
    mesh = p.device_mesh
    placements = list(p.placements)
    if unsharded:
        names = mesh.mesh_dim_names or ()
        placements = [
            Replicate() if n in _FSDP_AXES else pl for n, pl in zip(names, placements, strict=True)
        ]
        coordinate = [0] * mesh.ndim
    else:
        coordinate = _coordinate(mesh.mesh, rank)
    return math.prod(local_shape(tuple(p.shape), tuple(mesh.mesh.shape), coordinate, placements))


def _piece_bytes(model: torch.nn.Module, piece_of: Any, world: int, job: JobConfig) -> _Pieces:
    named = list(model.named_parameters())
    rank_bytes: list[dict[str, tuple[int, int]]] = []
    for rank in range(world):
        table: dict[str, tuple[int, int]] = {}
        for name, p in named:
            nbytes, count = table.get(piece_of(name), (0, 0))
            table[piece_of(name)] = (nbytes + _local_numel(p, rank) * p.element_size(), count + 1)
        rank_bytes.append(table)
    policy = mixed_precision_policy(job)
    groups: dict[str, tuple[int, int]] = {}
    all_grads: dict[str, int] = {}
    names = {id(p): n for n, p in named}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        managed = _managed_params(module)
        if not managed:
            continue
        piece = piece_of(names[id(managed[0])])
        params = grads = 0
        for p in managed:
            numel = _local_numel(p, 0, unsharded=True)
            compute = policy.param_dtype if policy and policy.param_dtype else p.dtype
            reduce = policy.reduce_dtype if policy and policy.reduce_dtype else compute
            params += numel * compute.itemsize
            grads += numel * reduce.itemsize
        all_grads[piece] = all_grads.get(piece, 0) + grads
        if params > groups.get(piece, (0, 0))[0]:
            groups[piece] = (params, grads)
    largest: dict[str, list[tuple[int, str]]] = {}
    for n, p in named:
        largest.setdefault(piece_of(n), []).append((_local_numel(p, 0) * p.element_size(), n))
    largest = {piece: sorted(rows, reverse=True)[:3] for piece, rows in largest.items()}
    return _Pieces(rank_bytes, groups, all_grads, largest)


def _managed_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module``'s own FSDP group (not those of a nested one)."""
    inner = {
        id(p)
        for sub in module.modules()
        if sub is not module and isinstance(sub, FSDPModule)
        for p in sub.parameters()
    }
    return [p for p in module.parameters() if id(p) not in inner]


def _measure(
    model: torch.nn.Module,
    job: JobConfig,
    layers_attr: str,
    kinds: list[str],
    microbatch: int,
    packed: bool,
) -> _Activations:
    """One microbatch's forward and loss over fake tensors, counting the saved storages."""
    layers = list(getattr(model, layers_attr, []))
    blocks = [(f"{layers_attr}.{i}", kinds[i], block) for i, block in enumerate(layers)]
    seq = job.training.seq_len
    with fake_world(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        # torch's notice that selective checkpointing bypasses outer hooks: counted apart here
        warnings.filterwarnings("ignore", "A saved_tensors_hooks context", FutureWarning)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.zero_()  # no values exist: this marks every state written
        tokens = torch.zeros(microbatch, seq, dtype=torch.long)
        targets = torch.zeros(microbatch, seq, dtype=torch.long)  # its own storage, as a run's
        inputs: dict[str, torch.Tensor] = {}
        if packed and "document_ids" in inspect.signature(model.loss).parameters:  # type: ignore[arg-type]
            ids = torch.zeros(microbatch, seq, dtype=torch.long)
            ids[:, seq // 2 :] = 1
            inputs["document_ids"] = ids
        dtype = autocast_dtype(job)
        cast = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()

        def run() -> None:
            with cast:
                model.loss(tokens, targets, **inputs)  # type: ignore[operator]

        counted = count_activations(model, blocks, run)
    pieces = {"first": counted.by_label.get("first", 0), "last": counted.by_label.get("last", 0)}
    sent = {p: counted.collectives.get(p, {}) for p in ("first", "last")}
    piece_of = {"first": "first", "last": "last"}
    for label, kind, _ in blocks:
        pieces.setdefault(kind, counted.by_label.get(label, 0))
        sent.setdefault(kind, counted.collectives.get(label, {}))
        piece_of.setdefault(label, kind)
    largest: dict[str, list[tuple[int, str]]] = {}
    for nbytes, text in counted.largest:
        label, _, what = text.partition(": ")
        piece = piece_of.get(label)
        if piece is not None and len(largest.setdefault(piece, [])) < 3:
            largest[piece].append((nbytes, f"saved by {label}: {what}"))
    return _Activations(pieces, counted.recompute, counted.boundary, counted.logits, largest, sent)


# -- roles -----------------------------------------------------------------------------------
def _roles(
    job: JobConfig,
    world: int,
    sub_world: int,
    pieces: _Pieces,
    acts: _Activations,
    kinds: list[str],
    n_microbatches: int,
) -> list[RoleReport]:
    par = job.parallelism
    pp = par.pp
    starts = even_starts(len(kinds), pp) if kinds else [0] * pp
    roles: list[RoleReport] = []
    for stage in range(pp):
        end = starts[stage + 1] if stage + 1 < pp else len(kinds)
        counts: dict[str, int] = {}
        for kind in kinds[starts[stage] : end]:
            counts[kind] = counts.get(kind, 0) + 1
        held = dict(counts)
        if stage == 0:
            held["first"] = 1
        if stage == pp - 1:
            held["last"] = 1
        per_mb = sum(acts.pieces.get(p, 0) * n for p, n in held.items())
        recompute = max((acts.recompute.get(k, 0) for k in counts), default=0)
        activations = per_mb + recompute
        if pp == 1:
            in_flight = 1
        elif par.pipeline_schedule.lower() in _ALL_FORWARD_FIRST:
            in_flight = n_microbatches
        else:
            in_flight = min(n_microbatches, pp - stage)
        output = acts.logits if stage == pp - 1 else acts.boundary * in_flight
        sent: dict[str, int] = {}
        for piece, n in held.items():
            for axis, nbytes in acts.collectives.get(piece, {}).items():
                sent[axis] = sent.get(axis, 0) + nbytes * n
        groups = [pieces.fsdp_groups[p] for p in held if p in pieces.fsdp_groups]
        biggest = max(groups, default=(0, 0))
        fsdp = 2 * biggest[0] + biggest[1]
        if pp > 1 and n_microbatches > 1:
            # a pipeline defers FSDP's reduce-scatter to the last microbatch's backward: every
            # group's unsharded gradient is accumulated until then
            fsdp = 2 * biggest[0] + sum(pieces.fsdp_grads.get(p, 0) * n for p, n in held.items())
        by_bytes: dict[tuple[int, int], list[int]] = {}
        for sub_rank, table in enumerate(pieces.rank_bytes):
            nbytes = sum(table.get(p, (0, 0))[0] * n for p, n in held.items())
            tensors = sum(table.get(p, (0, 0))[1] * n for p, n in held.items())
            by_bytes.setdefault((nbytes, tensors), []).append(stage * sub_world + sub_rank)
        for (params, tensors), ranks in sorted(by_bytes.items(), key=lambda kv: kv[1][0]):
            optimizer = 2 * params + 4 * tensors  # AdamW's two moments and its step counts
            total = params * 2 + optimizer + per_mb * in_flight + recompute + output + fsdp
            largest = sorted(
                (
                    row
                    for piece in held
                    for row in (*pieces.largest_params.get(piece, ()), *acts.largest.get(piece, ()))
                ),
                reverse=True,
            )[:4]
            roles.append(
                RoleReport(
                    ranks=ranks,
                    params_bytes=params,
                    grads_bytes=params,
                    optimizer_bytes=optimizer,
                    activations_bytes=activations,
                    total_bytes=total,
                    largest=largest,
                    stage=stage,
                    microbatches_in_flight=in_flight,
                    fsdp_unsharded_bytes=fsdp,
                    output_bytes=output,
                    forward_collective_bytes=dict(sent),
                )
            )
    assert sorted(r for role in roles for r in role.ranks) == list(range(world))
    return roles

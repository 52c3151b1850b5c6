"""The demo's llama-ref training on one rank (tp, dp, FSDP/HSDP, pp) and its one-process reference.

:func:`train_rank` is what every rank runs (``--model qwen3-moe``, ``--cp`` and
``--packed`` runs go on to ``demo_layouts.py``); :func:`train_reference` is the same
training in one process, the oracle every step's loss is compared with.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Any

import torch

from hyper_parallel.dmodule.checkpoint import ModelState, TrainingState, load, save, step_path
from hyper_parallel.dmodule.demo_layouts import train_layout_rank, train_layout_reference
from hyper_parallel.dmodule.demo_options import Options, RankReport, stages_per_rank
from hyper_parallel.dmodule.demo_report import count_collectives, print_step, sharding_plan
from hyper_parallel.dmodule.models.llama import Llama, apply_fsdp, pipeline_llama
from hyper_parallel.dmodule.models.training import synthetic_batch, train_step
from hyper_parallel.dmodule.pipeline import Pipeline, stage_owner
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    FallbackWarning,
    collectives,
    init_device_mesh,
)
from hyper_parallel.platform import get_platform

__all__ = ["train_pipelined", "train_rank", "train_reference"]


def train_rank(options: Options) -> RankReport | None:
    """One rank's training (inside a process group); rank 0 returns its report.

    Example::

        >>> run_distributed(train_rank, 2, args=(parse_args([]),))  # doctest: +SKIP
    """
    if options.uses_layouts:  # with or without --pp: the ParallelDims path
        return train_layout_rank(options)
    if options.pp > 1:
        return train_pipelined(options)
    platform = get_platform()
    rank = platform.get_rank()
    device = platform.device_for(options.device)
    fsdp = options.dp_shard * options.dp_replicate > 1
    if fsdp:  # TP, then fully_shard over dp_shard (HSDP with dp_replicate)
        dp_axes: tuple[str, ...] = ("dp_replicate", "dp_shard")
        shape: tuple[int, ...] = (options.dp_replicate, options.dp_shard, options.tp)
    else:
        dp_axes, shape = ("dp",), (options.dp, options.tp)
    mesh = init_device_mesh(options.device, shape, mesh_dim_names=(*dp_axes, "tp"))
    model = _built_model(options, mesh, fsdp, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, foreach=False)
    train = TrainingState(device=device)
    app = {"app": ModelState(model, optimizer), "train": train}
    if options.resume:
        _resume(app, options, rank)
    history: list[float] = list(train.extra.get("losses", []))
    first_step = train.step + 1
    dp_rank, dp_size = _data_parallel_rank(mesh, dp_axes)
    local_batch = options.batch_size // dp_size
    state_bytes = (0, 0)
    losses: list[float] = []
    seconds: list[float] = []
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for step in range(first_step, options.steps + 1):
        start = time.perf_counter()
        tokens, targets = _rank_batch(options, step, dp_rank, local_batch, device)
        step_counts: Counter[str] = Counter()
        with count_collectives(step_counts, nbytes if step == first_step else Counter()):
            # the shared step (hp-train's too): forward, backward, gradient average, update
            result = train_step(
                model, [(tokens, targets)], optimizer, average_over=None if fsdp else (mesh, "dp")
            )
        if step == first_step:
            state_bytes = _state_bytes(model, optimizer)
        loss = torch.tensor(result.loss, device=device)  # this rank's; averaged over dp here
        reported = collectives.all_reduce_over(loss, mesh, dp_axes, "avg")
        seconds.append(time.perf_counter() - start)
        losses.append(float(reported.item()))
        if step == first_step:
            counts = step_counts
        if rank == 0:
            print_step(step, options.steps, losses[-1], seconds[-1])
        train.step = train.data_position = step  # the data of step s is synthetic_batch(s)
        if _checkpoint_due(options, step):
            assert options.checkpoint_dir is not None  # _checkpoint_due checked
            train.extra["losses"] = history + losses
            path = save(app, options.checkpoint_dir, step=step)
            if rank == 0:
                print(f"  [rank 0] checkpoint {path}", flush=True)
    if rank != 0:
        return None
    return RankReport(
        losses,
        sharding_plan(model),
        {k: (counts[k], nbytes[k]) for k in counts},
        seconds,
        first_step,
        history,
        state_bytes=state_bytes,
    )


def train_pipelined(options: Options) -> RankReport | None:
    """One rank of a ``--pp`` run: this rank's stages over a ``(pp, dp, tp)`` mesh.

    Example::

        >>> run_distributed(train_pipelined, 4, args=(parse_args(["--pp", "2"]),))  # doctest: +SKIP
    """
    platform = get_platform()
    rank = platform.get_rank()
    device = platform.device_for(options.device)
    # with --dp-shard each stage is fully sharded over it (parallelize_llama's apply_fsdp),
    # which averages the gradients; plain --dp averages them here
    fsdp = options.dp_shard > 1
    data_axis = "dp_shard" if fsdp else "dp"
    data_size = options.dp_shard if fsdp else options.dp
    mesh = init_device_mesh(
        options.device,
        (options.pp, data_size, options.tp),
        mesh_dim_names=("pp", data_axis, "tp"),
    )
    with torch.device("meta"):
        model = options.model.build()
    pipeline_options = {
        "schedule": options.schedule,
        "n_microbatches": options.microbatches,
        "stages_per_rank": stages_per_rank(options.schedule),
    }
    # llama-ref's ModelSpec.pipelining_fn: pipeline() with the model's loss
    pipe: Pipeline = pipeline_llama(model, mesh, {"pipeline": pipeline_options})
    torch.manual_seed(options.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # as in train_rank
        pipe.init_weights(buffer_device=device)
    params = [p for part in pipe.model_parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=options.lr, foreach=False)
    dp_rank, local_batch = mesh.get_local_rank(data_axis), options.batch_size // data_size
    last_owner = stage_owner(pipe.num_stages - 1, options.pp, options.schedule)
    losses: list[float] = []
    seconds: list[float] = []
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for step in range(1, options.steps + 1):
        start = time.perf_counter()
        tokens, targets = _rank_batch(options, step, dp_rank, local_batch, device)
        step_counts: Counter[str] = Counter()
        with count_collectives(step_counts, nbytes if step == 1 else Counter()):
            # the shared step: the schedule, then (plain --dp) the gradient average, the update
            result = train_step(
                pipe, [(tokens, targets)], optimizer, average_over=None if fsdp else (mesh, "dp")
            )
        mine = torch.tensor([result.loss], device=device)  # the last stage's; 0 on the others
        mine = collectives.all_reduce(mine, mesh, data_axis, "avg")
        reported = collectives.broadcast(mine, mesh, "pp", last_owner)
        seconds.append(time.perf_counter() - start)
        losses.append(float(reported.item()))
        if step == 1:
            counts = step_counts
        if rank == 0:
            print_step(step, options.steps, losses[-1], seconds[-1])
    local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)
    everyone = init_device_mesh(options.device, (options.pp * data_size * options.tp,))
    gathered = collectives.all_gather(torch.tensor([local_bytes], device=device), everyone, 0)
    if rank != 0:
        return None
    plan = [row for part in pipe.model_parts for row in sharding_plan(part)]
    return RankReport(
        losses,
        plan,
        {k: (counts[k], nbytes[k]) for k in counts},
        seconds,
        param_bytes=[int(b) for b in gathered.flatten().tolist()],
    )


def _rank_batch(
    options: Options, step: int, dp_rank: int, local_batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the step's global batch (every rank draws the same)."""
    tokens, targets = synthetic_batch(
        step,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        vocab_size=options.model.vocab_size,
        seed=options.seed,
    )
    rows = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
    return tokens[rows].to(device), targets[rows].to(device)


def _built_model(options: Options, mesh: DeviceMesh, fsdp: bool, device: torch.device) -> Llama:
    """llama-ref built on meta, tensor parallel (then fully sharded), given memory, initialised."""
    with torch.device("meta"):
        model: Llama = options.model.build()
    model.parallelize(mesh["tp"])
    if fsdp:
        apply_fsdp(model, mesh)
    model.to_empty(device=device)
    torch.manual_seed(options.seed)
    with warnings.catch_warnings():
        # Random init fills full tensors and keeps this rank's slice, by design (the values
        # match a one-process init); only fallbacks during training are worth a warning.
        warnings.simplefilter("ignore", FallbackWarning)
        model.init_weights(buffer_device=device)
    return model


def _resume(app: dict[str, Any], options: Options, rank: int) -> None:
    assert options.checkpoint_dir is not None  # parse_args checked
    loaded = load(app, options.checkpoint_dir)  # resharded onto this run's mesh
    if rank == 0:
        print(
            f"  [rank 0] resumed from {step_path(options.checkpoint_dir, loaded)} "
            f"onto tp={options.tp} dp={options.dp}",
            flush=True,
        )


def _data_parallel_rank(mesh: DeviceMesh, dp_axes: tuple[str, ...]) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks, and their number."""
    dp_rank, dp_size = 0, 1
    for axis in dp_axes:  # row-major over the data-parallel axes
        dp_rank, dp_size = (
            dp_rank * mesh.size(axis) + mesh.get_local_rank(axis),
            dp_size * mesh.size(axis),
        )
    return dp_rank, dp_size


def _checkpoint_due(options: Options, step: int) -> bool:
    """Save after ``step``: every ``--checkpoint-every`` steps and after the last."""
    every = options.checkpoint_every
    return bool(options.checkpoint_dir) and (
        step == options.steps or bool(every and step % every == 0)
    )


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """This rank's parameter + gradient + optimizer-state bytes, and the full model's."""

    def local(t: torch.Tensor) -> int:
        shard = t.to_local() if isinstance(t, DTensor) else t
        return shard.numel() * shard.element_size()

    mine, full = 0, 0
    for p in model.parameters():
        mine += 2 * local(p)  # the parameter and its gradient, which has the parameter's layout
        full += 2 * p.numel() * p.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                mine += local(value)
                full += value.numel() * value.element_size()
    return mine, full


def train_reference(options: Options) -> list[float]:
    """The same training in this one process: full model, full batch, same seed and data."""
    if options.uses_layouts:
        return train_layout_reference(options)
    device = get_platform().device_for(options.device) if options.device != "cpu" else None
    if device is None:
        torch.set_num_threads(1)  # a tiny model: extra threads only contend with other work
    torch.manual_seed(options.seed)
    model = options.model.build()
    if device is not None:
        model.to(device)
    model.init_weights(buffer_device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, foreach=False)
    losses = []
    for step in range(1, options.steps + 1):
        tokens, targets = synthetic_batch(
            step,
            batch_size=options.batch_size,
            seq_len=options.seq_len,
            vocab_size=options.model.vocab_size,
            seed=options.seed,
        )
        batch = (tokens.to(device or "cpu"), targets.to(device or "cpu"))
        losses.append(train_step(model, [batch], optimizer).loss)
    return losses

"""The hp-dmodule demo: train the reference Llama tensor parallel on local processes, check parity.

Run ``python -m hyper_parallel.dmodule.demo --help``. Spawns ``dp * tp`` ranks with the
built-in launcher (or runs as one rank under ``torchrun``), trains the ``llama-ref``
model on synthetic tokens, and compares every step's loss with a single-process run of
the same config, seed and data. Exit status: 0 parity holds, 1 parity fails or a rank
failed, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.config import ConfigError, Configurable, parse_cli_overrides
from hyper_parallel.dmodule.checkpoint import (
    ModelState,
    TrainingState,
    latest_step,
    load,
    save,
    step_path,
)
from hyper_parallel.dmodule.demo_layouts import (
    add_layout_arguments,
    fill_dp_shard_for_ep,
    layout_problems,
    split_model_choice,
    train_layout_rank,
    train_layout_reference,
    uses_layouts,
)
from hyper_parallel.dmodule.models.llama import Llama, apply_fsdp
from hyper_parallel.dmodule.models.training import synthetic_batch, train_step
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    FallbackWarning,
    collectives,
    init_device_mesh,
)
from hyper_parallel.platform import get_platform

__all__ = ["RELATIVE_TOLERANCE", "main"]

#: Parity passes when every step's |loss - single-process loss| <= this x |single-process loss|.
RELATIVE_TOLERANCE = 1e-4


class DemoJob(Configurable):
    """The part of the demo's command line that hp-config owns: ``--model.<field>=value``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """``model``: the reference model's config (``--model.dim=128``)."""

        model: Llama.Config = field(default_factory=Llama.Config)

    def __init__(self, *, config: DemoJob.Config) -> None:
        self.config = config


@dataclass(frozen=True)
class Options:
    """Everything a rank needs (picklable)."""

    model: Llama.Config
    tp: int
    dp: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    device: str
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    pp: int = 1
    schedule: str = "1F1B"
    microbatches: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    plot: str = "out/loss_curve.png"
    timeout: float = 300.0
    # the ParallelDims layouts (demo_layouts.py): qwen3-moe with --ep, llama-ref with --cp
    model_name: str = "llama-ref"
    ep: int = 1
    experts: int = 8
    cp: int = 1
    cp_attention: str = "allgather"
    packed: bool = False

    @property
    def world(self) -> int:
        """Ranks the run needs: ``tp x dp x pp x dp_shard x dp_replicate x cp``."""
        return self.tp * self.dp * self.pp * self.dp_shard * self.dp_replicate * self.cp


@dataclass
class RankReport:
    """What rank 0 sends back: losses (dp-averaged), plan, collectives, timings.

    After ``--resume``, ``losses`` start at ``first_step``; ``history`` holds the
    losses of the steps before it (saved in the checkpoint by the earlier run).
    """

    losses: list[float]
    plan: list[tuple[str, str, str, tuple[int, ...], tuple[int, ...]]]
    collectives: dict[str, tuple[int, int]]
    step_seconds: list[float]
    first_step: int = 1
    history: list[float] = field(default_factory=list)
    #: With ``--pp``: every rank's parameter bytes (its stages' local shards), in rank order.
    param_bytes: list[int] = field(default_factory=list)
    state_bytes: tuple[int, int] = (0, 0)  # this rank's params + grads + optimizer; full model's
    #: Lines a layout adds to the report (the experts' load, cp's activation bytes).
    sections: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str]) -> Options:
    """Parse the demo's command line (``--model.*`` through hp-config, the rest through argparse).

    Example::

        >>> parse_args(["--tp", "2", "--model.dim=32"]).model.dim
        32
    """
    parser = _parser()
    argv, model_choice = split_model_choice(list(argv))  # `--model NAME`, not a config key
    try:
        overrides, rest = parse_cli_overrides(argv, DemoJob.Config)
    except ConfigError as error:  # e.g. `--model.dim` as the last argument: a usage error
        parser.error(error.message)
    args = parser.parse_args(rest + model_choice)
    if args.ep >= 1 and args.tp >= 1:
        fill_dp_shard_for_ep(args)  # before the checks: the batch must divide by it
    try:
        model = DemoJob.Config().apply_overrides(overrides).model
    except ConfigError as error:
        parser.error(f"--{error}")
    problems = [
        *_size_problems(args, model),
        *_checkpoint_problems(args),
        *_pipeline_problems(args, model),
        *layout_problems(args, model),
    ]
    if problems:
        parser.error("; ".join(problems))
    return Options(
        model,
        args.tp,
        args.dp,
        args.steps,
        args.batch_size,
        args.seq_len,
        args.lr,
        args.seed,
        args.device,
        args.checkpoint_dir,
        args.checkpoint_every,
        args.resume,
        args.pp,
        args.schedule,
        args.microbatches or args.pp,
        args.dp_shard,
        args.dp_replicate,
        args.plot,
        args.timeout,
        model_name=args.model_name,
        ep=args.ep,
        experts=args.experts,
        cp=args.cp,
        cp_attention=args.cp_attention,
        packed=args.packed,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hyper_parallel.dmodule.demo",
        description="Train the llama-ref model tensor parallel on local processes and check "
        "its losses against a single-process run. Model fields: --model.<field>=VALUE "
        f"(fields: {', '.join(Llama.Config.__dataclass_fields__)}).",
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument(
        "--dp-shard", type=int, default=1, help="fully sharded data-parallel size (FSDP)"
    )
    parser.add_argument(
        "--dp-replicate", type=int, default=1, help="HSDP replicas of the --dp-shard groups"
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    parser.add_argument("--plot", default="out/loss_curve.png", help="loss-curve PNG path")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    parser.add_argument(
        "--checkpoint-dir", default=None, help="save DCP checkpoints here (DIR/step-N)"
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save every N steps (and after the last); 0: only after the last",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (any --tp/--dp)",
    )
    _add_pipeline_arguments(parser)
    add_layout_arguments(parser)
    return parser


def _size_problems(args: argparse.Namespace, model: Llama.Config) -> list[str]:
    """What is wrong with the parallel sizes, the batch and the sequence length."""
    problems: list[str] = []
    if args.tp < 1 or args.dp < 1 or args.steps < 1:
        problems.append(
            f"--tp, --dp and --steps must be >= 1 (found {args.tp}, {args.dp}, {args.steps})"
        )
    if args.batch_size % args.dp:
        problems.append(f"--batch-size {args.batch_size} must divide by --dp {args.dp}")
    if args.dp_shard < 1 or args.dp_replicate < 1:
        problems.append(
            f"--dp-shard and --dp-replicate must be >= 1 (found {args.dp_shard}, "
            f"{args.dp_replicate})"
        )
    elif args.dp_shard * args.dp_replicate > 1:
        if args.dp > 1:
            problems.append("--dp (replicated) cannot be combined with --dp-shard/--dp-replicate")
        if args.dp_replicate > 1 and args.dp_shard == 1:
            problems.append("--dp-replicate needs --dp-shard > 1 (for plain replicas use --dp)")
        if args.batch_size % (args.dp_shard * args.dp_replicate):
            problems.append(
                f"--batch-size {args.batch_size} must divide by --dp-shard x --dp-replicate "
                f"{args.dp_shard * args.dp_replicate}"
            )
    if args.seq_len > model.max_seq_len:
        problems.append(f"--seq-len {args.seq_len} exceeds --model.max_seq_len {model.max_seq_len}")
    return problems


def _checkpoint_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with ``--checkpoint-every`` and ``--resume``."""
    problems: list[str] = []
    if args.checkpoint_every < 0:
        problems.append(f"--checkpoint-every must be >= 0 (found {args.checkpoint_every})")
    if args.resume:
        found = None if args.checkpoint_dir is None else latest_step(args.checkpoint_dir)
        if args.checkpoint_dir is None:
            problems.append("--resume needs --checkpoint-dir")
        elif found is None:
            problems.append(f"--resume: no committed checkpoint (step-N) in {args.checkpoint_dir}")
        elif found >= args.steps:
            problems.append(
                f"--resume: the latest checkpoint is step {found}; --steps {args.steps}"
            )
    return problems


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    from hyper_parallel.dmodule.pipeline import SCHEDULES

    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel stages (default 1: no pipeline)"
    )
    parser.add_argument(
        "--schedule",
        default="1F1B",
        choices=SCHEDULES,
        help="torch's pipeline schedule with --pp (default 1F1B; multi-stage ones hold 2 "
        "stages per rank)",
    )
    parser.add_argument(
        "--microbatches", type=int, default=0, help="microbatches per step with --pp (default: pp)"
    )


def _pipeline_problems(args: argparse.Namespace, model: Llama.Config) -> list[str]:
    if args.pp < 1 or args.microbatches < 0:
        return [f"--pp must be >= 1 and --microbatches >= 0 (found {args.pp}, {args.microbatches})"]
    if args.pp == 1:
        return []
    problems = []
    microbatches = args.microbatches or args.pp
    sharded = args.dp_shard > 1
    data_parallel = args.dp_shard if sharded else max(args.dp, 1)
    if (args.batch_size // data_parallel) % microbatches:
        problems.append(
            f"--batch-size {args.batch_size} / --{'dp-shard' if sharded else 'dp'} "
            f"{data_parallel} must divide by --microbatches {microbatches}"
        )
    stages = args.pp * _stages_per_rank(args.schedule)
    if model.n_layers < stages:
        problems.append(
            f"--pp {args.pp} with {args.schedule} needs {stages} stages, more than "
            f"--model.n_layers {model.n_layers}"
        )
    if args.checkpoint_dir or args.resume:
        problems.append("--checkpoint-dir and --resume do not support --pp yet")
    if args.dp_replicate > 1:
        problems.append("--dp-replicate does not compose with --pp yet (--dp-shard does)")
    return problems


def _stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("GPipe", "1F1B") else 2


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


def train_pipelined(options: Options) -> RankReport | None:
    """One rank of a ``--pp`` run: this rank's stages over a ``(pp, dp, tp)`` mesh.

    Example::

        >>> run_distributed(train_pipelined, 4, args=(parse_args(["--pp", "2"]),))  # doctest: +SKIP
    """
    from hyper_parallel.dmodule.models.llama import pipeline_llama
    from hyper_parallel.dmodule.pipeline import Pipeline, stage_owner

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
        "stages_per_rank": _stages_per_rank(options.schedule),
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
            _print_step(step, options.steps, losses[-1], seconds[-1])
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


@contextmanager
def count_collectives(counts: Counter[str], nbytes: Counter[str]) -> Iterator[None]:
    """Count the collectives issued inside the block by kind (and their bytes per rank)."""

    def recorder(record: collectives.CollectiveRecord) -> None:
        counts[record.kind] += 1
        nbytes[record.kind] += record.nbytes

    with collectives.observe_collectives(recorder):
        yield


def train_rank(options: Options) -> RankReport | None:
    """One rank's training (inside a process group); rank 0 returns its report.

    Example::

        >>> run_distributed(train_rank, 2, args=(parse_args([]),))  # doctest: +SKIP
    """
    if uses_layouts(options):  # with or without --pp: the ParallelDims path
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
            _print_step(step, options.steps, losses[-1], seconds[-1])
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


def _print_step(step: int, steps: int, loss: float, seconds: float) -> None:
    print(
        f"  [rank 0] step {step:3d}/{steps}  loss {loss:.6f}  {seconds * 1000:7.1f} ms", flush=True
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


def sharding_plan(
    model: torch.nn.Module,
) -> list[tuple[str, str, str, tuple[int, ...], tuple[int, ...]]]:
    """``(module, parameter, placements, global shape, local shape)`` of every parameter.

    Example::

        >>> sharding_plan(model)[0]  # doctest: +SKIP
        ('tok_embeddings', 'weight', '[Shard(dim=0)]', (256, 64), (128, 64))
    """
    rows = []
    for fqn, param in model.named_parameters():
        module, _, name = fqn.rpartition(".")
        if isinstance(param, DTensor):
            placements = "[" + ", ".join(map(repr, param.placements)) + "]"
            local = tuple(param.to_local().shape)
        else:
            placements, local = "(plain tensor)", tuple(param.shape)
        rows.append((module, name, placements, tuple(param.shape), local))
    return rows


def train_reference(options: Options) -> list[float]:
    """The same training in this one process: full model, full batch, same seed and data."""
    if uses_layouts(options):
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


def report(options: Options, result: RankReport, reference: list[float], elapsed: float) -> int:
    """Print the plan, collectives and loss comparison; write the plot; return the exit status."""
    print(f"\nsharding plan (mesh axis 'tp' of size {options.tp}; rank 0's shards):")
    width = max(len(row[0]) for row in result.plan) + 2
    print(f"  {'module':<{width}}{'param':<8}{'placement':<24}{'global shape':<16}local shape")
    for module, name, placements, full_shape, local in result.plan:
        print(f"  {module:<{width}}{name:<8}{placements:<24}{full_shape!s:<16}{local}")
    mine, full = result.state_bytes
    if full:
        print(
            f"\nparameters + gradients + optimizer state per rank: {mine / 1024:.1f} KiB "
            f"(the full model's: {full / 1024:.1f} KiB, {full / max(mine, 1):.2f}x more)"
        )
    print("\ncollectives per training step (rank 0; forward + backward + dp gradient average):")
    for kind, (count, nbytes) in sorted(result.collectives.items()):
        print(f"  {kind:<15} x{count:<4} {nbytes / 1024:9.1f} KiB")
    if not result.collectives:
        print("  none")
    if result.param_bytes:
        print(
            f"\nparameter bytes per rank (pp={options.pp}, {options.schedule}, "
            f"{options.microbatches} microbatches; pipeline sends are torch's, not counted above):"
        )
        total = sum(result.param_bytes) / options.dp  # dp ranks hold copies
        share = 1 / (options.pp * options.tp * options.dp_shard)
        split = "pp x tp x dp_shard" if options.dp_shard > 1 else "pp x tp"
        for r, nbytes in enumerate(result.param_bytes):
            print(
                f"  rank {r}: {nbytes / 1024:9.1f} KiB  ({nbytes / total:.3f} of the model; "
                f"1 / ({split}) = {share:.3f})"
            )
    if result.sections:
        print("\n" + "\n".join(result.sections))
    print("\nloss: parallel vs single process (same seed, same data)")
    if result.first_step > 1:
        print(f"  (resumed at step {result.first_step}; earlier steps ran before the checkpoint)")
    print(f"  {'step':>4}  {'parallel':>10}  {'single':>10}  {'|delta|':>9}")
    worst, worst_rel = 0.0, 0.0
    compared = zip(result.losses, reference[result.first_step - 1 :], strict=True)
    for step, (par, ref) in enumerate(compared, start=result.first_step):
        delta = abs(par - ref)
        worst, worst_rel = max(worst, delta), max(worst_rel, delta / max(abs(ref), 1e-12))
        print(f"  {step:>4}  {par:10.6f}  {ref:10.6f}  {delta:9.2e}")
    plot = write_plot(
        Path(options.plot),
        result.history + result.losses,
        reference,
        options,
        resumed_at=result.first_step if result.first_step > 1 else None,
    )
    ok = worst_rel <= RELATIVE_TOLERANCE
    median_ms = sorted(result.step_seconds)[len(result.step_seconds) // 2] * 1000
    print(
        f"\nmax |delta loss| = {worst:.2e} (relative {worst_rel:.2e}); tolerance "
        f"{RELATIVE_TOLERANCE:g} relative: {'PASS' if ok else 'FAIL'}"
    )
    print(f"loss curve: {plot}; median step {median_ms:.1f} ms; total {elapsed:.1f} s")
    return 0 if ok else 1


def write_plot(
    path: Path,
    parallel: list[float],
    reference: list[float],
    options: Options,
    *,
    resumed_at: int | None = None,
) -> Path:
    """Write the loss curves (parallel and single process) as a PNG (matplotlib, Agg).

    ``resumed_at``: the first step of a resumed run, marked by a vertical line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    first = len(reference) - len(parallel) + 1  # a resumed run without history starts later
    axes.plot(
        range(1, len(reference) + 1), reference, label="single process", linewidth=3, alpha=0.5
    )
    label = f"tp={options.tp} dp={options.dp}" + (f" pp={options.pp}" if options.pp > 1 else "")
    label += " (resumed)" if resumed_at else ""
    axes.plot(range(first, len(reference) + 1), parallel, label=label, linestyle="--")
    if resumed_at is not None:
        axes.axvline(
            resumed_at - 0.5, color="gray", linestyle=":", label=f"resume (step {resumed_at})"
        )
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy loss")
    title = "llama-ref: tensor parallel vs single process"
    if uses_layouts(options):  # demo_layouts' runs: name the model and the layout
        layout = f"ep={options.ep}" if options.ep > 1 else f"cp={options.cp}"
        layout += f" pp={options.pp}" if options.pp > 1 else ""
        title = f"{options.model_name} ({layout}): parallel vs single process"
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return its exit status.

    Example::

        >>> main(["--tp", "2", "--steps", "2"])  # doctest: +SKIP
        0
    """
    options = parse_args(sys.argv[1:] if argv is None else argv)
    world = options.world
    cfg = options.model
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    start = time.perf_counter()
    fields = ", ".join(
        f"{k}={getattr(cfg, k)}"
        for k in Llama.Config.__dataclass_fields__
        if k not in ("param_init", "sharding_config")
    )
    launcher = "torchrun" if under_torchrun else "built-in launcher"
    fsdp = options.dp_shard * options.dp_replicate > 1
    sharded = f" dp_shard={options.dp_shard} dp_replicate={options.dp_replicate}" if fsdp else ""
    if uses_layouts(options):
        sharded += f" cp={options.cp} ({options.cp_attention})" if options.cp > 1 else ""
        sharded += f" ep={options.ep} ({options.experts} experts)" if options.ep > 1 else ""
        sharded += " packed documents" if options.packed else ""
    print(
        f"hp-dmodule demo: {options.model_name}, tp={options.tp} dp={options.dp}{sharded}"
        + (f" pp={options.pp} ({options.schedule})" if options.pp > 1 else "")
        + f" on {world} "
        f"{options.device} processes ({launcher}); {options.steps} steps, batch "
        f"{options.batch_size} x {options.seq_len} tokens, seed {options.seed}\n  model: "
        f"{fields}",
        flush=True,
    )
    if under_torchrun:
        return _main_torchrun(options, world, start)
    from hyper_parallel.platform_torch.launch import DistributedRunError, run_distributed

    try:
        results = run_distributed(
            train_rank,
            world,
            args=(options,),
            device_type=options.device,
            timeout_s=options.timeout,
        )
    except DistributedRunError as error:
        print(f"\ndemo FAILED: {str(error).splitlines()[0]}", file=sys.stderr)
        print("\n".join(str(error).splitlines()[1:]), file=sys.stderr)
        print("every rank process was stopped.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo interrupted (Ctrl-C): every rank process was stopped.", file=sys.stderr)
        return 130
    result = results[0]
    assert result is not None
    print("  single-process reference run ...", flush=True)
    reference = train_reference(options)
    return report(options, result, reference, time.perf_counter() - start)


def _main_torchrun(options: Options, world: int, start: float) -> int:
    """Under torchrun: this process is one rank; rank 0 also runs the reference and reports."""
    from hyper_parallel.platform_torch.launch import PROCESS_GROUP_MARGIN_S, lost_peer
    from hyper_parallel.platform_torch.stalls import stall_watchdog

    platform = get_platform()
    if int(os.environ["WORLD_SIZE"]) != world:
        print(
            f"demo: WORLD_SIZE={os.environ['WORLD_SIZE']} but --tp x --dp x --pp x "
            f"--dp-shard x --dp-replicate = {world}",
            file=sys.stderr,
        )
        return 2
    if options.device == "cpu":
        torch.set_num_threads(1)
    # The watchdog (--timeout) reports a stall, naming the ranks that did not arrive, and ends
    # this rank so that torchrun stops the others: before any collective's own timeout.
    platform.init_process_group(options.device, timeout_s=options.timeout + PROCESS_GROUP_MARGIN_S)
    try:
        try:
            with stall_watchdog(options.timeout):
                result = train_rank(options)
        except Exception as error:
            lost = lost_peer(error)
            if lost is None:
                raise
            # one line per rank saying what went away (another node, under torchrun), then
            # the traceback; exit 1 so that this node's agent stops its other workers
            print(f"demo FAILED: {lost.line}", file=sys.stderr, flush=True)
            traceback.print_exc()
            return 1
        status = 0
        if result is not None:
            reference = train_reference(options)
            status = report(options, result, reference, time.perf_counter() - start)
        everyone = init_device_mesh(options.device, (world,))
        device = platform.device_for(options.device)
        flag = collectives.broadcast(torch.tensor([status], device=device), everyone, 0, 0)
        return int(flag.item())
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

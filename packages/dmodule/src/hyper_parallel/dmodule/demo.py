"""The hp-dmodule demo: train the reference Llama tensor parallel on local processes, check parity.

Run ``python -m hyper_parallel.dmodule.demo --help``. This file reads the command line and
launches the ranks; ``demo_train.py`` (and ``demo_layouts.py`` for the ParallelDims
layouts) trains, ``demo_report.py`` prints the report. Spawns ``dp * tp`` ranks with the
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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyper_parallel.config import ConfigError, Configurable, parse_cli_overrides
from hyper_parallel.dmodule.checkpoint import latest_step
from hyper_parallel.dmodule.demo_layouts import (
    add_layout_arguments,
    fill_dp_shard_for_ep,
    layout_problems,
    split_model_choice,
)
from hyper_parallel.dmodule.demo_options import Options, stages_per_rank
from hyper_parallel.dmodule.demo_report import RELATIVE_TOLERANCE, report
from hyper_parallel.dmodule.demo_train import train_rank, train_reference
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.pipeline import SCHEDULES
from hyper_parallel.dtensor import collectives, init_device_mesh
from hyper_parallel.platform import get_platform

# main() launches the train_rank named here: a test's wrapper may replace it (demo.train_rank)
__all__ = ["RELATIVE_TOLERANCE", "main", "parse_args", "train_rank"]


class DemoJob(Configurable):
    """The part of the demo's command line that hp-config owns: ``--model.<field>=value``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """``model``: the reference model's config (``--model.dim=128``)."""

        model: Llama.Config = field(default_factory=Llama.Config)

    def __init__(self, *, config: DemoJob.Config) -> None:
        self.config = config


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
    stages = args.pp * stages_per_rank(args.schedule)
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
    if options.uses_layouts:
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

"""The ``hp-train`` command: read the job, check it, start the ranks (or join torchrun's), train."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hyper_parallel.config import ConfigError, parse_cli_overrides
from hyper_parallel.train.config import JobConfig, load_job, to_toml

if TYPE_CHECKING:
    from hyper_parallel.train.trainer import RunSummary

__all__ = ["main", "parse_args", "preflight"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-train",
        description="Train a model of the hp-dmodule registry on text, with every parallelism "
        "of the job's [parallelism] degrees. Any key of the job: --section.key=VALUE "
        "(e.g. --training.steps=200). With no --config: llama-ref on the built-in corpus. "
        "'hp-train prepare INPUT OUT' tokenizes a corpus once into memory-mapped shards "
        "(hp-train prepare --help).",
    )
    parser.add_argument("--config", default=None, help="the job's TOML file")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved job as TOML (reads back to the same job) and exit",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in checkpoint.dir",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="start no process: simulate one rank per role (pipeline stage, uneven shards) on "
        "fake tensors and torch's fake process group; print each role's memory and its ranks",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --dry-run or --plan: print one JSON object on stdout and nothing else there",
    )
    parser.add_argument(
        "--dry-run-packed",
        action="store_true",
        help="with --dry-run: measure activations with two documents packed in each row",
    )
    parser.add_argument(
        "--dry-run-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="with --dry-run: refuse a layout needing more than GIB per rank",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="the ranks to start (or plan, with --dry-run) when parallelism.dp_shard = -1 "
        "(the rest of the world); under torchrun its WORLD_SIZE",
    )
    parser.add_argument(
        "--allow-import",
        action="append",
        default=[],
        metavar="MODULE",
        help="also resolve 'module:function' callables of the job from MODULE (repeatable)",
    )
    _add_plan_arguments(parser)
    return parser


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--plan`` and its options (hyper_parallel.train.plan)."""
    group = parser.add_argument_group(
        "layout planner",
        "--plan --world-size N --device-memory GIB: rank the layouts of the job's model, "
        "sequence and global batch on N ranks, each measured by the dry run",
    )
    group.add_argument(
        "--plan",
        action="store_true",
        help="search dp_replicate/dp_shard/cp/tp/pp/ep/etp, activation checkpointing and "
        "microbatches; print the layouts that fit, fastest (estimated) first",
    )
    group.add_argument(
        "--device-memory", type=float, default=None, metavar="GIB", help="each rank's memory"
    )
    group.add_argument(
        "--device",
        default="h100",
        help="the accelerator: h100, h200, h800, a100, a800, mi300x, 910b (default h100)",
    )
    group.add_argument(
        "--gpus-per-node", type=int, default=None, metavar="G", help="default: the device's (8)"
    )
    group.add_argument("--peak-tflops", type=float, default=None, help="the device's peak")
    group.add_argument(
        "--intra-node-gbps", type=float, default=None, help="GB/s per device inside a node"
    )
    group.add_argument(
        "--inter-node-gbps", type=float, default=None, help="GB/s per device across nodes"
    )
    group.add_argument(
        "--plan-out", default=None, metavar="TOML", help="write the best layout as a job file"
    )
    group.add_argument(
        "--plan-top", type=int, default=3, metavar="K", help="stop once K layouts fit (3)"
    )


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, JobConfig]:
    """The options and the checked job of a command line (usage errors exit with status 2).

    Example::

        >>> parse_args(["--training.steps=3"])[1].training.steps
        3
    """
    parser = _parser()
    try:
        overrides, rest = parse_cli_overrides(list(argv), JobConfig)
    except ConfigError as error:
        parser.error(str(error))
    args = parser.parse_args(rest)
    if args.world_size is not None and args.world_size < 1:
        parser.error(
            f"--world-size: expected an int >= 1 (the ranks to start), found {args.world_size}"
        )
    if args.dry_run_memory is not None and not args.dry_run_memory > 0:
        parser.error(f"--dry-run-memory: expected GiB > 0 per rank, found {args.dry_run_memory:g}")
    try:
        job = load_job(args.config, overrides, allow_imports=args.allow_import)
    except ConfigError as error:
        parser.error(str(error))
    return args, job


def preflight(
    job: JobConfig,
    *,
    resume: bool,
    allow_imports: Sequence[str] = (),
    world_size: int | None = None,
) -> int:
    """Everything checkable before a process starts; the world size to launch.

    The world is torchrun's ``WORLD_SIZE``, else ``world_size`` (``--world-size``), else
    the product of the degrees (``parallelism.dp_shard = -1`` needs one of the first two).
    Raises ConfigError (or FileNotFoundError for data) naming the key.
    """
    from hyper_parallel.train.checkpoints import (
        check_checkpoint_dir,
        check_resume,
        check_resumed_model,
    )
    from hyper_parallel.train.job_data import check_data
    from hyper_parallel.train.metrics import check_metrics_extras
    from hyper_parallel.train.tokenizer import build_tokenizer
    from hyper_parallel.train.trainer import build_model_config, check_layout

    check_metrics_extras(job)
    tokenizer = build_tokenizer(job.tokenizer.path)
    model_config = build_model_config(job, tokenizer.vocab_size, tuple(allow_imports))
    check_data(job)
    world = int(os.environ.get("WORLD_SIZE", 0)) or world_size or job.parallelism.world_size
    if world < 1:
        raise ConfigError(
            "-1 takes the rest of the world: expected a world size (--world-size N, or torchrun's "
            "WORLD_SIZE), found none",
            path="parallelism.dp_shard",
        )
    check_layout(job, world)
    check_checkpoint_dir(job, resume=resume)
    if resume:
        # one process reads the checkpoint's files: the launcher, or torchrun's rank 0
        first = int(os.environ.get("RANK", "0")) == 0
        step = check_resume(job, verify=first)
        if first:  # after the manifest check: the shapes are read from DCP's pickled metadata
            check_resumed_model(job, model_config, step)
    return world


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hp-train``; return the exit status (0 done, 1 a rank failed, 2 bad input, 130 Ctrl-C).

    Under the built-in launcher, a first Ctrl-C (or SIGINT/SIGTERM to the launcher) makes
    every rank finish its step, save it when ``checkpoint.dir`` is set, and exit (status
    130; ``--resume`` continues); a second one kills the ranks.

    Example::

        >>> main(["--print-config"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        from hyper_parallel.train.prepare import prepare_main

        return prepare_main(argv[1:])
    args, job = parse_args(argv)
    if args.print_config:
        sys.stdout.write(to_toml(job))
        return 0
    if args.plan:
        return _plan(args, job)
    from hyper_parallel.train.trainer import resolve_world

    try:
        world = preflight(
            job, resume=args.resume, allow_imports=args.allow_import, world_size=args.world_size
        )
        job = resolve_world(job, world)
        if args.dry_run:
            return _dry_run(job, world, args)
    except (ConfigError, FileNotFoundError, ModuleNotFoundError, ValueError) as error:
        print(f"hp-train: error: {error}", file=sys.stderr)
        return 2
    options = {"resume": args.resume, "allow_imports": tuple(args.allow_import)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _under_torchrun(job, options)
    from hyper_parallel.platform_torch.launch import DistributedRunError, run_distributed

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hp-train-") as scratch:
        interrupts = _Interrupts(os.path.join(scratch, "stop"))
        try:
            with interrupts.installed():
                summaries = run_distributed(
                    _rank_main,
                    world,
                    args=(job,),
                    kwargs={**options, "stop_file": interrupts.stop_file},
                    device_type=job.training.device,
                    timeout_s=job.training.timeout,
                )
        except DistributedRunError as error:
            print(f"hp-train FAILED: {error}", file=sys.stderr)
            print("every rank process was stopped.", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nhp-train interrupted: every rank process was stopped.", file=sys.stderr)
            return 130
    summary = summaries[0]
    if summary is not None and summary.stopped_by_signal:
        saved = (
            f"checkpoint {summary.last_checkpoint}; continue with --resume"
            if summary.last_checkpoint
            else "nothing saved (checkpoint.dir is not set)"
        )
        last = summary.first_step + len(summary.losses) - 1
        print(f"[hp-train] stopped by a signal after step {last}: {saved}", file=sys.stderr)
        return 130
    print(
        f"[hp-train] {world} rank(s) finished in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return 0


def _plan(args: argparse.Namespace, job: JobConfig) -> int:
    """``--plan``: 0 when a layout fits, 1 when none does, 2 on bad input."""
    from hyper_parallel.train.plan_report import plan_command

    try:
        return plan_command(
            job,
            world_size=args.world_size,
            device_memory_gib=args.device_memory,
            device=args.device,
            gpus_per_node=args.gpus_per_node,
            peak_tflops=args.peak_tflops,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            as_json=args.json,
            plan_out=args.plan_out,
            top=args.plan_top,
            allow_imports=tuple(args.allow_import),
        )
    except (ConfigError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"hp-train: error: {error}", file=sys.stderr)
        return 2


def _dry_run(job: JobConfig, world: int, args: argparse.Namespace) -> int:
    """``--dry-run``: the table (or ``--json``'s object, alone on stdout), then the budget."""
    from hyper_parallel.train.dry_run import check_memory, dry_run, format_report

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the report alone
        report = dry_run(
            job, world, allow_imports=tuple(args.allow_import), packed=args.dry_run_packed
        )
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_report(job, report))
    if args.dry_run_memory is not None:
        check_memory(report, args.dry_run_memory)
    return 0


class _Interrupts:
    """The launcher's SIGINT/SIGTERM: the first asks every rank to stop after its step, the next kills.

    A terminal's Ctrl-C reaches the launcher and the ranks (one process group); a signal to
    the launcher's pid reaches it alone. Either way the launcher creates ``stop_file``, which
    every rank looks for after each step (the ranks ignore SIGINT outside their steps, so a
    Ctrl-C while they start or save does not break them), then saves that step and exits.
    A second signal raises KeyboardInterrupt here: the launcher kills the ranks.
    """

    def __init__(self, stop_file: str) -> None:
        self.stop_file = stop_file
        self.received = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received > 1:
            raise KeyboardInterrupt
        Path(self.stop_file).touch()
        print(
            f"\n[hp-train] {signal.Signals(signum).name}: every rank stops after its current "
            "step and saves it (when checkpoint.dir is set); Ctrl-C again to kill",
            file=sys.stderr,
            flush=True,
        )

    @contextmanager
    def installed(self) -> Iterator[None]:
        """SIGINT and SIGTERM handled as above while the ranks run."""
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _rank_main(
    job: JobConfig, *, resume: bool, allow_imports: tuple[str, ...], stop_file: str
) -> RunSummary | None:
    """One rank under the built-in launcher: the launcher alone answers a terminal's Ctrl-C."""
    started = time.perf_counter()
    from hyper_parallel.train.metrics import StartupTimes
    from hyper_parallel.train.trainer import train

    times = StartupTimes()
    times.seconds["imports"] = time.perf_counter() - started
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return train(
        job, resume=resume, allow_imports=allow_imports, stop_file=stop_file, startup=times
    )


def _under_torchrun(job: JobConfig, options: dict[str, object]) -> int:
    """This process is one rank of torchrun's world."""
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    from hyper_parallel.platform import get_platform
    from hyper_parallel.train.metrics import StartupTimes
    from hyper_parallel.train.trainer import train

    times = StartupTimes()
    times.seconds["imports"] = time.perf_counter() - started
    if job.training.device == "cpu":
        torch.set_num_threads(1)
    get_platform().init_process_group(job.training.device, timeout_s=job.training.timeout)
    try:
        train(
            job,
            resume=bool(options["resume"]),
            allow_imports=tuple(options["allow_imports"]),  # type: ignore[arg-type]
            startup=times,
        )
    finally:
        dist.destroy_process_group()
    return 0

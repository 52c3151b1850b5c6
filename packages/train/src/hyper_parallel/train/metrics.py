"""Metrics on rank 0: console lines with a progress bar, JSONL records, TensorBoard, a PNG at the end.

Also what a run reports: its startup phases' times and, on rank 0, its :class:`RunSummary`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.train.config import JobConfig

__all__ = [
    "PEAK_TFLOPS",
    "MetricsLogger",
    "RunSummary",
    "StartupTimes",
    "StepMetrics",
    "check_metrics_extras",
    "peak_tflops",
]

#: Dense bf16 peak TFLOPs of common accelerators (by a substring of the device name).
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
    "Ascend910B": 313.0,
}


def peak_tflops(device: torch.device, configured: float = 0.0) -> float | None:
    """The device's peak TFLOPs: ``configured`` if > 0, else the table's; None on CPU or unknown.

    Example::

        >>> peak_tflops(torch.device("cpu")) is None
        True
    """
    if configured > 0:
        return configured
    if device.type == "cpu":
        return None
    try:
        name = torch.get_device_module(device).get_device_name(device)
    except (AttributeError, RuntimeError):
        return None
    compact = name.replace(" ", "")
    for key, value in PEAK_TFLOPS.items():
        if key in compact:
            return value
    return None


def check_metrics_extras(job: JobConfig) -> None:
    """Stop before training when a metrics output needs a package that is not installed."""
    if job.metrics.tensorboard_dir:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as error:
            raise ConfigError(
                f"expected the 'tensorboard' package to write event files, found it missing "
                f"({error}): pip install 'hp-train[tensorboard]'",
                path="metrics.tensorboard_dir",
            ) from error
    if job.metrics.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ConfigError(
                "expected 'matplotlib' to draw the PNG, found it missing: "
                "pip install 'hp-train[plot]' (or leave metrics.plot empty)",
                path="metrics.plot",
            ) from error


@dataclass
class RunSummary:
    """What rank 0 returns: every step's loss and rate of this run, and the validation losses."""

    first_step: int
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    #: wall seconds of each step (data, forward, backward, update, loss reduction)
    seconds: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    stopped_by_signal: bool = False
    last_checkpoint: str = ""
    #: wall seconds of each startup phase of this rank (see :class:`StartupTimes`)
    startup_seconds: dict[str, float] = field(default_factory=dict)


class StartupTimes:
    """Wall seconds of a rank's startup phases, in the order they ran, for one console line.

    Example::

        >>> times = StartupTimes()
        >>> with times.phase("mesh"):
        ...     pass
        >>> times.line().startswith("startup: mesh 0.0")
        True
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def line(self) -> str:
        """``startup: imports 1.20 s, mesh 0.05 s, ... (total 2.31 s)``."""
        phases = ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())
        return f"startup: {phases} (total {sum(self.seconds.values()):.2f} s)"


@dataclass(frozen=True)
class StepMetrics:
    """One logged training step."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_second: float
    tflops_per_device: float
    data_wait: float
    epoch: float
    memory_gib: float


class MetricsLogger:
    """Rank 0's outputs; other ranks hold one that writes nothing.

    Example::

        logger = MetricsLogger(job, rank=0, resumed_after=None)
        logger.log_step(StepMetrics(...), steps=100)
    """

    def __init__(self, job: JobConfig, *, rank: int, resumed_after: int | None) -> None:
        self.job, self.rank = job, rank
        self.enabled = rank == 0
        self.device = torch.device(job.training.device)
        self.peak = peak_tflops(self.device, job.metrics.peak_tflops)
        self._jsonl: Any = None
        self._writer: Any = None
        self._start = time.perf_counter()
        self._first_step = 1
        self._history: list[tuple[int, float, float]] = []
        self._val: list[tuple[int, float]] = []
        if not self.enabled:
            return
        check_metrics_extras(job)
        if job.metrics.jsonl:
            path = Path(job.metrics.jsonl)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_after is not None and path.is_file():
                # a resumed run appends to the earlier run's records up to its checkpoint
                # (steps logged after it, before a crash, are run and logged again)
                kept = [
                    line
                    for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if line.strip() and json.loads(line).get("step", 0) <= resumed_after
                ]
                path.write_text("".join(kept), encoding="utf-8")
            self._jsonl = path.open("a" if resumed_after is not None else "w", encoding="utf-8")
        if job.metrics.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=job.metrics.tensorboard_dir)

    def start(self, *, nparams: int, world: int, first_step: int) -> None:
        """Print the run's header."""
        self._first_step = first_step
        self._start = time.perf_counter()
        if not self.enabled:
            return
        job = self.job
        mfu = (
            f"peak {self.peak:g} TFLOPs/device"
            if self.peak
            else "MFU is not meaningful on CPU"
            if self.device.type == "cpu"
            else "peak unknown (set metrics.peak_tflops for MFU)"
        )
        self.note(
            f"hp-train: {job.model.name} ({job.model.flavor}), {nparams:,} parameters, "
            f"{world} {job.training.device} rank(s); steps {first_step}..{job.training.steps}, "
            f"batch {job.training.global_batch_size} x {job.training.seq_len} tokens; {mfu}"
        )

    def note(self, text: str) -> None:
        """One line on the console (rank 0)."""
        if self.enabled:
            print(f"[hp-train] {text}", file=sys.stderr, flush=True)

    def log_step(self, m: StepMetrics, *, steps: int) -> None:
        """Console line, JSONL record and TensorBoard scalars of a training step."""
        if not self.enabled:
            return
        self._history.append((m.step, m.loss, m.lr))
        mfu = None if self.peak is None else m.tflops_per_device / self.peak
        done = m.step - self._first_step + 1
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (steps - m.step)
        width = 20
        filled = int(width * m.step / steps)
        bar = "#" * filled + "." * (width - filled)
        norm = "n/a" if m.grad_norm is None else f"{m.grad_norm:.3f}"
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        print(
            f"[{bar}] step {m.step}/{steps}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad_norm {norm}  "
            f"{m.tokens_per_second:,.0f} tok/s  {m.tflops_per_device:.3g} TFLOPs/dev  "
            f"MFU {mfu_text}  mem {m.memory_gib:.2f} GiB  data {100 * m.data_wait:.1f}%  "
            f"ETA {eta:.0f}s",
            flush=True,
        )
        record: dict[str, Any] = {
            "step": m.step,
            "loss": m.loss,
            "lr": m.lr,
            "grad_norm": m.grad_norm,
            "tokens_per_second": m.tokens_per_second,
            "tflops_per_device": m.tflops_per_device,
            "mfu": mfu,
            "memory_gib": m.memory_gib,
            "data_wait": m.data_wait,
            "epoch": m.epoch,
        }
        self._write(record)
        if self._writer is not None:
            scalars = {
                "loss/train": m.loss,
                "lr": m.lr,
                "throughput/tokens_per_second": m.tokens_per_second,
                "throughput/tflops_per_device": m.tflops_per_device,
                "memory/peak_gib": m.memory_gib,
                "time/data_wait": m.data_wait,
            }
            if m.grad_norm is not None:
                scalars["grad_norm"] = m.grad_norm
            if mfu is not None:
                scalars["throughput/mfu"] = mfu
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, m.step)

    def log_validation(self, step: int, loss: float) -> None:
        """Validation loss and perplexity: console, JSONL, TensorBoard."""
        if not self.enabled:
            return
        self._val.append((step, loss))
        perplexity = math.exp(min(loss, 700.0))
        print(
            f"  validation at step {step}: loss {loss:.4f}  perplexity {perplexity:.2f}", flush=True
        )
        self._write({"step": step, "val_loss": loss, "val_perplexity": perplexity})
        if self._writer is not None:
            self._writer.add_scalar("loss/val", loss, step)
            self._writer.add_scalar("perplexity/val", perplexity, step)

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def finish(self, summary: RunSummary) -> None:
        """Close the files and draw the PNG of loss and LR."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        if self.job.metrics.plot and self._history:
            self.note(
                f"loss and LR: {write_plot(Path(self.job.metrics.plot), self._history, self._val)}"
            )
        self.note(f"done in {time.perf_counter() - self._start:.1f} s")


def write_plot(
    path: Path, history: list[tuple[int, float, float]], val: list[tuple[int, float]]
) -> Path:
    """A PNG of the training (and validation) loss and the LR by step (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, (loss_axes, lr_axes) = plt.subplots(2, 1, figsize=(6, 5), dpi=100, sharex=True)
    steps = [s for s, _, _ in history]
    loss_axes.plot(steps, [loss for _, loss, _ in history], label="train")
    if val:
        loss_axes.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation")
    loss_axes.set_ylabel("loss")
    loss_axes.legend()
    lr_axes.plot(steps, [lr for _, _, lr in history])
    lr_axes.set_ylabel("learning rate")
    lr_axes.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

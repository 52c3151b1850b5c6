"""What the demo shows: the sharding plan, the collectives, the loss against one process, the plot.

``demo_train.py`` and ``demo_layouts.py`` collect a :class:`RankReport` on rank 0 (with
:func:`sharding_plan` and :func:`count_collectives`); :func:`report` prints it and says
whether parity holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from hyper_parallel.dmodule.demo_options import Options, RankReport
from hyper_parallel.dtensor import DTensor, collectives

__all__ = [
    "RELATIVE_TOLERANCE",
    "PlanRow",
    "count_collectives",
    "plan_table",
    "print_step",
    "report",
    "sharding_plan",
    "write_plot",
]

#: Parity passes when every step's |loss - single-process loss| <= this x |single-process loss|.
RELATIVE_TOLERANCE = 1e-4

#: ``(module, parameter, placements, global shape, local shape)`` of one parameter.
PlanRow = tuple[str, str, str, tuple[int, ...], tuple[int, ...]]


@contextmanager
def count_collectives(counts: Counter[str], nbytes: Counter[str]) -> Iterator[None]:
    """Count the collectives issued inside the block by kind (and their bytes per rank)."""

    def recorder(record: collectives.CollectiveRecord) -> None:
        counts[record.kind] += 1
        nbytes[record.kind] += record.nbytes

    with collectives.observe_collectives(recorder):
        yield


def print_step(step: int, steps: int, loss: float, seconds: float) -> None:
    """Rank 0's line for one training step."""
    print(
        f"  [rank 0] step {step:3d}/{steps}  loss {loss:.6f}  {seconds * 1000:7.1f} ms", flush=True
    )


def sharding_plan(model: torch.nn.Module) -> list[PlanRow]:
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


def plan_table(plan: Sequence[PlanRow]) -> list[str]:
    """The plan as aligned lines: each column as wide as its widest entry, two spaces between.

    A 2-D mesh's placements (``[_StridedShard(dim=0, sf=2), Shard(dim=0)]``) widen their
    column instead of running into the next one.

    Example::

        >>> for line in plan_table([("output", "weight", "[Shard(dim=0)]", (256, 64), (128, 64))]):
        ...     print(line)
          module  param   placement       global shape  local shape
          output  weight  [Shard(dim=0)]  (256, 64)     (128, 64)
    """
    header = ("module", "param", "placement", "global shape", "local shape")
    rows = [header, *((m, n, p, str(full), str(local)) for m, n, p, full, local in plan)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  "
        + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def report(options: Options, result: RankReport, reference: list[float], elapsed: float) -> int:
    """Print the plan, collectives and loss comparison; write the plot; return the exit status."""
    print(f"\nsharding plan (mesh axis 'tp' of size {options.tp}; rank 0's shards):")
    print("\n".join(plan_table(result.plan)))
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
    if options.uses_layouts:  # demo_layouts' runs: name the model and the layout
        layout = f"ep={options.ep}" if options.ep > 1 else f"cp={options.cp}"
        layout += f" pp={options.pp}" if options.pp > 1 else ""
        title = f"{options.model_name} ({layout}): parallel vs single process"
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path

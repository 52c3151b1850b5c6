"""What a demo rank is given (:class:`Options`) and what rank 0 gives back (:class:`RankReport`).

The demo's command line (``demo.py``) makes the options; the training (``demo_train.py``,
``demo_layouts.py``) reads them and returns the report; ``demo_report.py`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyper_parallel.dmodule.models.llama import Llama

__all__ = ["Options", "RankReport", "stages_per_rank"]


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

    @property
    def uses_layouts(self) -> bool:
        """Whether the run takes ``demo_layouts.py``'s path (qwen3-moe, ``--cp`` or ``--packed``)."""
        return self.model_name != "llama-ref" or self.cp > 1 or self.packed


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


def stages_per_rank(schedule: str) -> int:
    """The pipeline stages each rank holds under ``schedule`` (multi-stage ones hold 2).

    Example::

        >>> stages_per_rank("1F1B"), stages_per_rank("Interleaved1F1B")
        (1, 2)
    """
    return 1 if schedule in ("GPipe", "1F1B") else 2

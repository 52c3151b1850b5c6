"""torch's pipeline schedules: their names, where their stages sit, the microbatch counts."""

from __future__ import annotations

#: torch's schedule names (``get_schedule_class`` takes them case-insensitively).
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_SINGLE_STAGE = frozenset({"gpipe", "1f1b"})
# torch places the stages of these in a V: rank r holds stages r and 2 * pp - 1 - r
_V_SHAPED = frozenset({"zbvzerobubble", "dualpipev"})


def stage_owner(stage: int, pp: int, schedule: str) -> int:
    """The ``pp`` rank that holds ``stage`` under ``schedule`` (as torch's schedules place stages).

    Looped schedules deal stages round-robin; V-shaped ones (ZBV, DualPipeV) go down
    and back up, so rank 0 holds the first and the last stage.

    Example::

        >>> [stage_owner(s, 2, "Interleaved1F1B") for s in range(4)]
        [0, 1, 0, 1]
        >>> [stage_owner(s, 2, "ZBVZeroBubble") for s in range(4)]
        [0, 1, 1, 0]
    """
    if schedule.lower() in _V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _check_microbatches(
    name: str, n_microbatches: int, pp: int, num_stages: int, *, where: str
) -> None:
    """The microbatch counts torch's schedule constructors refuse, refused before anything is built."""
    key = name.lower()
    if key in ("1f1b", "dualpipev") and n_microbatches < num_stages:
        raise ValueError(
            f"{where}: schedule {name!r} needs at least as many microbatches as stages "
            f"({num_stages}); found n_microbatches={n_microbatches}"
        )
    if key in ("interleaved1f1b", "interleavedzerobubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"{where}: schedule {name!r} runs microbatches in rounds of pp={pp}; expected "
                f"n_microbatches < {pp} or a multiple of {rounds} (the number of rounds), "
                f"found {n_microbatches}"
            )


def _schedule_name(schedule: object, *, where: str) -> str:
    if isinstance(schedule, str):
        for name in SCHEDULES:
            if name.lower() == schedule.lower():
                return name
    raise ValueError(f"{where}: schedule: expected one of {list(SCHEDULES)}, found {schedule!r}")

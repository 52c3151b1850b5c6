"""Where collectives report themselves, so that a debug mode can count them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from hyper_parallel.platform import ReduceOpName, get_platform

__all__ = ["Recorder", "all_reduce_over", "record", "recording"]

Recorder = Callable[[str, int, int], None]
"""Called as ``recorder(kind, bytes_per_rank, group_size)`` for each collective."""

recording: ContextVar[tuple[Recorder, ...]] = ContextVar("hp_comm_recorders", default=())


def record(kind: str, tensor: torch.Tensor, group_size: int) -> None:
    """Tell the active recorders that a collective of ``kind`` moved ``tensor`` (this rank's input)."""
    recorders = recording.get()
    if recorders:
        nbytes = tensor.numel() * tensor.element_size()
        for recorder in recorders:
            recorder(kind, nbytes, group_size)


def all_reduce_over(
    tensor: torch.Tensor, groups: Sequence[Any], reduce_op: ReduceOpName
) -> torch.Tensor:
    """All-reduce ``tensor`` over each of ``groups`` in turn, reporting each collective.

    The in-kernel reductions of sharding rules (norms, loss parallel) use it, so that a
    comm debug mode sees them like the collectives of redistribution.
    """
    platform = get_platform()
    for group in groups:
        tensor = platform.all_reduce(tensor, group, reduce_op)
        record("all_reduce", tensor, 0)
    return tensor

"""Where collectives report themselves, so that a debug mode can count them."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

import torch

__all__ = ["Recorder", "record", "recording"]

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

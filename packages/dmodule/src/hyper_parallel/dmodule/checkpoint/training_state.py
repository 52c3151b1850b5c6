"""The loop's own state for an exact resume: step, data position and random generators."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from hyper_parallel.platform import get_platform

__all__ = ["TrainingState"]


class TrainingState(Stateful):
    """Step, data position and RNG states, saved and restored by DCP as a ``Stateful``.

    The RNG states (torch's CPU generator, the device generator when the device is
    not the CPU, Python's ``random``) are saved per rank; a rank loads its own, or
    rank 0's when the checkpoint was written by fewer ranks (hp's random ops keep
    the generator in step on every rank, so rank 0's is every rank's then).
    ``data_position`` is whatever the data pipeline needs to continue (here: the
    number of batches consumed); ``extra`` holds any other picklable values of the
    loop (the demo keeps its loss history there).

    Example::

        train = TrainingState(device=torch.device("cpu"))
        train.step += 1; train.data_position += 1
        save({"app": ModelState(model, optimizer), "train": train}, "ckpt", step=train.step)
    """

    def __init__(self, *, device: torch.device | None = None) -> None:
        self.step = 0
        self.data_position = 0
        self.extra: dict[str, Any] = {}
        self.device = device or torch.device("cpu")
        #: The rank whose RNG states :meth:`load_state_dict` takes (set by ``load``).
        self.rng_source_rank: int | None = None

    def _rank(self) -> int:
        platform = get_platform()
        return platform.get_rank() if platform.is_initialized() else 0

    def _rng(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
        }
        if self.device.type != "cpu":
            # torch's module of the device type (torch.cuda, torch.npu): its generator state
            states["device"] = torch.get_device_module(self.device).get_rng_state(self.device)
        return states

    def state_dict(self) -> dict[str, Any]:
        source = self._rank() if self.rng_source_rank is None else self.rng_source_rank
        return {
            "step": self.step,
            "data_position": self.data_position,
            # a tuple is one DCP leaf (a dict would be split into keys the loader must know)
            "extra": tuple(self.extra.items()),
            "rng": {f"rank{source}": self._rng()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.data_position = int(state_dict["data_position"])
        self.extra = dict(state_dict.get("extra", ()))
        (states,) = state_dict["rng"].values()
        torch.set_rng_state(states["torch"])
        random.setstate(states["python"])
        if "device" in states:
            torch.get_device_module(self.device).set_rng_state(states["device"], self.device)
        self.rng_source_rank = None

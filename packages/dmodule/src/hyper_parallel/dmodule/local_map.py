"""local_map: run a module's forward on the local shards of its states and inputs.

Inside a ``local_map`` block ops run on plain tensors (no DTensor dispatch); the
block writes its own collectives when it needs any and declares the layout of what
it returns with ``out_src_shardings``. Gradients reach the DTensor parameters
because ``DTensor.to_local`` is differentiable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hyper_parallel.dtensor import DTensor

__all__ = ["local_states"]


@contextmanager
def local_states(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, every DTensor parameter and buffer of ``module``'s subtree is local.

    Each is replaced by ``to_local()`` (differentiable, so gradients flow to the DTensor
    parameter) and put back on exit, also when the block raises.

    Example::

        with local_states(block):
            y = block.forward(x_local)   # block.weight is this rank's shard here
    """
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for sub in module.modules():
            state_dicts: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
            for states in state_dicts:
                for name, value in states.items():
                    if isinstance(value, DTensor):
                        swapped.append((states, name, value))
                        states[name] = value.to_local()
        yield
    finally:
        for states, name, value in reversed(swapped):
            states[name] = value

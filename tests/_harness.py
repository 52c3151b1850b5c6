"""Shared multi-process test harness: run a module-level test function on N CPU ranks.

Test modules write their per-rank bodies as module-level functions (so the rank
processes can import them by name) and call :func:`run_on_ranks`; any rank's
failure is raised in the test as a ``DistributedRunError`` with that rank's
traceback, and a hung rank is killed after ``timeout_s``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest

from hyper_parallel.platform_torch.launch import run_distributed

__all__ = ["TEST_DEVICE", "WORLD_SIZES", "run_on_ranks", "world_sizes"]

R = TypeVar("R")

# What nearly every rank of every test imports: loaded once in the forkserver instead.
_PRELOAD = ("hyper_parallel.dtensor", "hyper_parallel.dmodule", "hyper_parallel.config")

#: The world sizes multi-process tests run on by default.
WORLD_SIZES: tuple[int, ...] = (1, 2, 4)

#: The device type the suites that support it run on (``HP_TEST_DEVICE``, default cpu);
#: ``bench/gpu_smoke.sh`` sets ``cuda``.
TEST_DEVICE: str = os.environ.get("HP_TEST_DEVICE", "cpu")

# ``HP_TEST_WORLD_SIZES="1"`` replaces every world_sizes(...) choice (one GPU: one rank).
_FORCED_SIZES = tuple(int(n) for n in os.environ.get("HP_TEST_WORLD_SIZES", "").split())


def run_on_ranks(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    timeout_s: float = 120.0,
    device_type: str = TEST_DEVICE,
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` ranks with a process group; results in rank order.

    Example::

        >>> def rank_plus(offset: int) -> int:  # at module level in a test module
        ...     return torch.distributed.get_rank() + offset
        >>> run_on_ranks(rank_plus, 2, 10)  # doctest: +SKIP
        [10, 11]
    """
    return run_distributed(
        fn,
        world_size,
        args=args,
        device_type=device_type,
        timeout_s=timeout_s,
        preload=_PRELOAD,
    )


def world_sizes(*sizes: int) -> pytest.MarkDecorator:
    """Parametrize a test over ``world_size`` (default: :data:`WORLD_SIZES`).

    Example::

        >>> @world_sizes(2, 4)
        ... def test_all_gather(world_size: int) -> None: ...
    """
    chosen = _FORCED_SIZES or sizes or WORLD_SIZES
    return pytest.mark.parametrize("world_size", chosen, ids=[f"ws{n}" for n in chosen])

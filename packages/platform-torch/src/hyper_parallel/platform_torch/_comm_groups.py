"""The default process group and new groups: group-local rank order, the default group's timeout."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hyper_parallel.platform_torch.devices import backend_for, set_current_device

__all__ = [
    "default_group_timeout",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
]

_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def is_initialized() -> bool:
    """True once the default process group of this process exists.

    Example::

        >>> is_initialized()
        False
    """
    return dist.is_available() and dist.is_initialized()


def init_process_group(device_type: str, *, timeout_s: float = 300.0) -> None:
    """Create the default process group by env:// rendezvous, backend from ``device_type``.

    Reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (as set by
    :func:`hyper_parallel.platform_torch.launch.run_distributed` or torchrun); on
    accelerators it first makes ``LOCAL_RANK``'s device the current one.

    Example::

        >>> init_process_group("cpu", timeout_s=60)  # doctest: +SKIP
    """
    backend = backend_for(device_type)
    if is_initialized():
        raise RuntimeError(
            f"init_process_group({device_type!r}): the default process group already exists "
            f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()})"
        )
    missing = [name for name in _RENDEZVOUS_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_process_group({device_type!r}) needs the environment variables "
            f"{_RENDEZVOUS_VARS}; missing {tuple(missing)}. Start the processes with "
            f"hyper_parallel.platform_torch.launch.run_distributed or torchrun"
        )
    if timeout_s <= 0:
        raise ValueError(f"init_process_group: timeout_s must be > 0, got {timeout_s}")
    set_current_device(device_type)
    dist.init_process_group(
        backend=backend, init_method="env://", timeout=timedelta(seconds=timeout_s)
    )


def _require_initialized(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs the default process group; call init_process_group(device_type) "
            f"first or run under hyper_parallel.platform_torch.launch.run_distributed"
        )


def get_rank() -> int:
    """Global rank of this process.

    Example::

        >>> get_rank()  # doctest: +SKIP
        0
    """
    _require_initialized("get_rank()")
    return dist.get_rank()


def get_world_size() -> int:
    """Number of processes in the default group.

    Example::

        >>> get_world_size()  # doctest: +SKIP
        4
    """
    _require_initialized("get_world_size()")
    return dist.get_world_size()


@functools.cache
def _new_group_keeps_order() -> bool:
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def default_group_timeout() -> timedelta | None:
    """The timeout the default process group was created with (None when it cannot be read).

    ``torch.distributed.new_group`` without a timeout gives a group torch's backend
    default (30 minutes for gloo), not the default group's; :func:`new_group` passes this
    one instead, so a stall on any group fails within what ``init_process_group`` was given.

    Example::

        >>> default_group_timeout()  # doctest: +SKIP
        datetime.timedelta(seconds=180)
    """
    _require_initialized("default_group_timeout()")
    group = dist.group.WORLD
    assert group is not None
    for device in group._device_types:  # the backends of the default group (gloo: cpu)
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


@functools.cache
def _new_group_has_desc() -> bool:
    return "group_desc" in inspect.signature(dist.new_group).parameters


def new_group(ranks: Sequence[int], *, description: str | None = None) -> ProcessGroup:
    """A process group over global ``ranks`` whose group-rank ``i`` is ``ranks[i]``.

    Collective over the default group: every rank calls it with the same ranks, in
    the same order. On ranks outside ``ranks`` the result is a placeholder. The group
    has the default group's timeout (:func:`default_group_timeout`), as torch's would
    have had if it inherited it. ``description`` (e.g. "mesh axis 'dp' of ...") is the
    group's torch ``group_desc``, named by a :class:`PeerLostError` on it.

    Example::

        >>> pairs = [new_group(r) for r in ([0, 1], [2, 3])]  # doctest: +SKIP
    """
    _require_initialized("new_group()")
    world_size = dist.get_world_size()
    members = [int(rank) for rank in ranks]
    if not members:
        raise ValueError("new_group: expected at least one rank, got []")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks must be distinct, got {members}")
    out_of_range = [rank for rank in members if not 0 <= rank < world_size]
    if out_of_range:
        raise ValueError(
            f"new_group: ranks must be in [0, {world_size}) (the world size), "
            f"got {out_of_range} in {members}"
        )
    timeout = default_group_timeout()
    described: dict[str, Any] = {}
    if description and _new_group_has_desc():
        described["group_desc"] = description
    if _new_group_keeps_order():
        group = dist.new_group(ranks=members, timeout=timeout, sort_ranks=False, **described)
    elif members == sorted(members):
        group = dist.new_group(ranks=members, timeout=timeout, **described)
    else:
        raise ValueError(
            f"new_group: torch {torch.__version__} always sorts group ranks; "
            f"ranks must be ascending, got {members}"
        )
    return cast(ProcessGroup, group)

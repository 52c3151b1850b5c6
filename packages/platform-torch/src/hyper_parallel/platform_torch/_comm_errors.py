"""Collective failures named by rank, group and peers, and the decorator that raises them."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["CollectiveError", "CollectiveTimeoutError", "PeerLostError"]

# How backends (gloo's tcp transport) word a peer process that went away mid-collective.
_LOST_PEER_PHRASES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
)
_P = ParamSpec("_P")
_T = TypeVar("_T")


class CollectiveError(RuntimeError):
    """A collective failed on a peer's account; ``line`` says where, in one line.

    ``rank``, ``collective``, ``group`` (its description: for a ``DeviceMesh`` group, the
    mesh axis), ``ranks`` (the group's global ranks) and ``peers`` (the others); the
    backend's own error is chained as the cause.
    """

    _what = "failed"

    def __init__(
        self, rank: int, collective: str, group: str, ranks: list[int], backend_error: str
    ) -> None:
        self.rank, self.collective, self.group, self.ranks = rank, collective, group, ranks
        self.peers = [r for r in ranks if r != rank]
        cause = backend_error.strip().splitlines()[0] if backend_error.strip() else "?"
        if cause.startswith("[") and "] " in cause:  # gloo's "[.../pair.cc:561] " source prefix
            cause = cause.split("] ", 1)[1]
        cause = cause.split(". This is typically", 1)[0]
        self.line = self._line(cause[:200])
        super().__init__(self.line)

    def _line(self, cause: str) -> str:
        return (
            f"rank {self.rank}: {self.collective} on {self.group} (group ranks {self.ranks}) "
            f"{self._what} ({cause})"
        )


class PeerLostError(CollectiveError):
    """A collective failed because a process of its group went away (crashed, killed, node lost).

    Example::

        try:
            all_reduce(x, group, "sum")
        except PeerLostError as error:
            print(error.line)  # rank 0: lost a peer in all_reduce on mesh axis 'dp' ...
    """

    def _line(self, cause: str) -> str:
        return (
            f"rank {self.rank}: lost a peer in {self.collective} on {self.group} (group ranks "
            f"{self.ranks}): one of peer ranks {self.peers} went away ({cause})"
        )


class CollectiveTimeoutError(CollectiveError):
    """A collective ran past its group's timeout: a peer never arrived (stalled elsewhere).

    Example::

        try:
            all_reduce(x, group, "sum")
        except CollectiveTimeoutError as error:
            print(error.line)  # rank 0: all_reduce on mesh axis 'tp' ... timed out ...
    """

    def _line(self, cause: str) -> str:
        return (
            f"rank {self.rank}: {self.collective} on {self.group} (group ranks {self.ranks}) "
            f"timed out: one of peer ranks {self.peers} did not arrive within the group's "
            f"timeout ({cause})"
        )


def _describe_group(group: ProcessGroup | None) -> tuple[str, list[int]]:
    """The group's description (``new_group(description=...)``) and its global ranks."""
    if group is None or group is dist.group.WORLD:
        return "the default group", list(range(dist.get_world_size()))
    description = getattr(group, "group_desc", "") or ""
    if not description or description == "undefined":
        description = "a process group"
    return description, list(dist.get_process_group_ranks(group))


def _reports_lost_peers(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """A backend's "connection reset/closed by peer" or timeout in ``fn`` as a :class:`CollectiveError`."""
    name = fn.__name__

    @functools.wraps(fn)
    def collective(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as error:
            text = str(error)
            lowered = text.lower()
            kind: type[CollectiveError]
            if isinstance(error, CollectiveError):
                raise
            if any(phrase in lowered for phrase in _LOST_PEER_PHRASES):
                kind = PeerLostError
            elif "timed out" in lowered or "timeout" in lowered:
                kind = CollectiveTimeoutError
            else:
                raise
            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
            group = cast("ProcessGroup | None", bound.get("group"))
            described, ranks = _describe_group(group)
            raise kind(dist.get_rank(), name, described, ranks, text) from error

    return collective

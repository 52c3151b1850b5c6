"""Process groups and out-of-place collectives over torch.distributed, with group-local ranks.

Every collective returns a new contiguous tensor and leaves its input untouched;
inputs may be non-contiguous. ``group=None`` is the default (world) group. A
group of one process needs no communication and is answered locally.

Where a backend lacks a native collective (older gloo: reduce-scatter,
all-to-all, all-gather into one tensor) an equivalent built from the collectives
it has is used; which backends lack what is learnt from the first call that the
backend refuses (the refusal is local and identical on every rank).

``async_op=True`` (all-gather, all-reduce, reduce-scatter, all-to-all) issues torch's
functional collective (``torch.distributed._functional_collectives``) and returns its
``AsyncCollectiveTensor`` at once: the first op that reads it (other than a view), or
:func:`wait`, waits for the values. Where that is not possible (a group of one, an
``"avg"`` reduction, which gloo lacks natively, a backend without the functional
collective) the call completes before it returns, as without ``async_op``.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, ParamSpec, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from hyper_parallel.platform_torch.devices import backend_for, set_current_device

__all__ = [
    "REDUCE_OPS",
    "CollectiveError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "ReduceOpName",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "default_group_timeout",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "reduce_scatter",
    "scatter",
    "send_recv",
    "wait",
]

ReduceOpName = Literal["sum", "avg", "product", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "product", "max", "min")
_NATIVE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

# (backend, collective) pairs a backend refused as unsupported; see the module docstring.
_UNSUPPORTED: set[tuple[str, str]] = set()
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


# -- process groups ------------------------------------------------------------
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


# -- helpers -------------------------------------------------------------------
def _size_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _dense_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def _physical(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as contiguous memory holding its values.

    A lazily conjugated or negated view (``x.conj()``) shares the memory of ``x``; a
    backend sends memory, so the bit is resolved first (a no-op for other tensors).
    """
    return tensor.resolve_conj().resolve_neg().contiguous()


def _check_reduce_op(what: str, tensor: torch.Tensor, reduce_op: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"{what}: reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
    if reduce_op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"{what}(reduce_op='avg') needs a floating-point tensor, got dtype {tensor.dtype} "
            f"(an integer average would be truncated); convert with .float() or use 'sum'"
        )


def _check_leading(what: str, tensor: torch.Tensor, group_size: int) -> None:
    if tensor.dim() == 0 or tensor.shape[0] != group_size:
        raise ValueError(
            f"{what}: expected an input of shape (group_size={group_size}, *chunk), "
            f"got {tuple(tensor.shape)}"
        )


def _check_src(what: str, src: int, group_size: int) -> None:
    if not 0 <= src < group_size:
        raise ValueError(f"{what}: src must be a group rank in [0, {group_size}), got {src}")


def _is_unsupported(error: BaseException) -> bool:
    message = str(error).lower()
    return any(
        phrase in message
        for phrase in ("not support", "unsupported", "not implemented", "does not implement")
    )


def _native_or_fallback(
    collective: str,
    group: ProcessGroup | None,
    native: Callable[[], torch.Tensor],
    fallback: Callable[[], torch.Tensor],
) -> torch.Tensor:
    key = (dist.get_backend(group), collective)
    if key not in _UNSUPPORTED:
        try:
            return native()
        except (RuntimeError, NotImplementedError) as error:
            if not _is_unsupported(error):
                raise
            _UNSUPPORTED.add(key)
    return fallback()


def _issue_async(
    collective: str, group: ProcessGroup | None, issue: Callable[[ProcessGroup], torch.Tensor]
) -> torch.Tensor | None:
    """torch's functional ``collective``, pending (None where the backend refused it before)."""
    key = (dist.get_backend(group), f"functional {collective}")
    if key in _UNSUPPORTED:
        return None
    try:
        return issue(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
    except (RuntimeError, NotImplementedError) as error:
        if not _is_unsupported(error):
            raise
        _UNSUPPORTED.add(key)
        return None


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """The values of an ``async_op=True`` collective's result, waited for; any other tensor as is.

    Example::

        >>> pending = all_reduce(x, group, "sum", async_op=True)  # doctest: +SKIP
        >>> total = wait(pending)  # a plain tensor  # doctest: +SKIP
    """
    if isinstance(tensor, funcol.AsyncCollectiveTensor):
        return tensor.wait()
    works = _PENDING_P2P.pop(id(tensor), None)
    if works is not None:
        for work in works:
            work.wait()
    return tensor


# the point-to-point requests an ``async_op=True`` send_recv result still waits for
# (by the result's id; a result dropped unwaited drops its entry)
_PENDING_P2P: dict[int, list[Any]] = {}


@_reports_lost_peers
def send_recv(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    *,
    offset: int = 1,
    async_op: bool = False,
) -> torch.Tensor:
    """Send ``tensor`` to group rank ``rank + offset`` and return what ``rank - offset`` sent (a ring shift).

    Point-to-point (``batch_isend_irecv``); every rank of the group calls it with the
    same shape. ``async_op=True`` returns at once; :func:`wait` on the result waits.

    Example::

        >>> send_recv(torch.tensor([rank]), group)  # doctest: +SKIP
        tensor([1])  # on rank 0 of a 2-rank group
    """
    size, rank = _size_and_rank(group)
    source = _physical(tensor).contiguous()
    if size == 1 or offset % size == 0:
        return _dense_copy(source)
    out = torch.empty_like(source)
    ops = [
        dist.P2POp(dist.isend, source, _global_rank(group, (rank + offset) % size), group),
        dist.P2POp(dist.irecv, out, _global_rank(group, (rank - offset) % size), group),
    ]
    works = dist.batch_isend_irecv(ops)
    if async_op:
        _PENDING_P2P[id(out)] = [*works, _KeepAlive(source)]
        weakref.finalize(out, _PENDING_P2P.pop, id(out), None)
        return out
    for work in works:
        work.wait()
    return out


class _KeepAlive:
    """Holds a send buffer until its request is waited for."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> None:
        del self.tensor


# -- collectives ---------------------------------------------------------------
@_reports_lost_peers
def all_gather(
    tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
) -> torch.Tensor:
    """Stack every group rank's ``tensor`` (same shape everywhere) in group-rank order.

    Example::

        >>> all_gather(torch.tensor([rank]), group)  # doctest: +SKIP
        tensor([[0], [1]])  # on every rank of a 2-rank group
    """
    size, _ = _size_and_rank(group)
    source = _physical(tensor)
    if size == 1:
        return _dense_copy(source).unsqueeze(0)
    if async_op:
        gather_flat = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        pending = _issue_async("all_gather", group, lambda g: gather_flat(source.view(-1), 0, g))
        if pending is not None:
            return pending.view(size, *source.shape)  # a view: still pending
    out = source.new_empty((size, *source.shape))

    def native() -> torch.Tensor:
        # Flat views: the concatenated layout every backend accepts equals the stacked one.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), source.view(-1), group=group)
        return out

    def fallback() -> torch.Tensor:
        return _all_gather_by_list(source, out, group)

    return _native_or_fallback("all_gather_into_tensor", group, native, fallback)


def _all_gather_by_list(
    source: torch.Tensor, out: torch.Tensor, group: ProcessGroup | None
) -> torch.Tensor:
    dist.all_gather(list(out.unbind(0)), source, group=group)
    return out


@_reports_lost_peers
def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    reduce_op: ReduceOpName,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Element-wise ``reduce_op`` ("sum", "avg", "product", "max", "min") of every rank's ``tensor``.

    "avg" is a sum divided by the group size, on every backend; it needs a
    floating-point (or complex) dtype and raises ``TypeError`` for integers.

    Example::

        >>> all_reduce(torch.tensor([1.0 + rank]), group, "avg")  # doctest: +SKIP
        tensor([1.5])  # on every rank of a 2-rank group
    """
    _check_reduce_op("all_reduce", tensor, reduce_op)
    size = dist.get_world_size(group)
    if async_op and size > 1 and reduce_op != "avg":
        source = _physical(tensor)
        pending = _issue_async(
            "all_reduce", group, lambda g: funcol.all_reduce(source, reduce_op, g)
        )
        if pending is not None:
            return pending
    out = _dense_copy(tensor)
    if size == 1:
        return out
    dist.all_reduce(out, op=_NATIVE_OPS["sum" if reduce_op == "avg" else reduce_op], group=group)
    if reduce_op == "avg":
        out.div_(size)
    return out


@_reports_lost_peers
def reduce_scatter(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    reduce_op: ReduceOpName,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Reduce the ``(group_size, *chunk)`` inputs across ranks; return this rank's ``chunk``.

    Example::

        >>> reduce_scatter(torch.ones(2, 3), group, "sum")  # doctest: +SKIP
        tensor([2., 2., 2.])  # on every rank of a 2-rank group
    """
    _check_reduce_op("reduce_scatter", tensor, reduce_op)
    size, rank = _size_and_rank(group)
    _check_leading("reduce_scatter", tensor, size)
    if size == 1:
        return _dense_copy(tensor[0])
    source = _physical(tensor)
    if async_op and reduce_op != "avg":
        scatter_flat = (
            getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        )
        pending = _issue_async(
            "reduce_scatter", group, lambda g: scatter_flat(source.view(-1), reduce_op, 0, g)
        )
        if pending is not None:
            return pending.view(source.shape[1:])
    op = _NATIVE_OPS["sum" if reduce_op == "avg" else reduce_op]

    def native() -> torch.Tensor:
        out = source.new_empty(source.shape[1:])
        reduce_scatter_single = getattr(dist, "reduce_scatter_single", None)
        if reduce_scatter_single is None:
            dist.reduce_scatter_tensor(out.view(-1), source.view(-1), op=op, group=group)
        else:
            reduce_scatter_single(out.view(-1), source.view(-1), op=op, group=group)
        return out

    def fallback() -> torch.Tensor:
        reduced = _dense_copy(source)
        dist.all_reduce(reduced, op=op, group=group)
        return reduced[rank].clone()

    out = _native_or_fallback("reduce_scatter", group, native, fallback)
    if reduce_op == "avg":
        out.div_(size)
    return out


@_reports_lost_peers
def all_to_all(
    tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
) -> torch.Tensor:
    """Send input slot ``i`` to group-rank ``i``; output slot ``j`` came from group-rank ``j``.

    Example::

        >>> all_to_all(torch.tensor([10 * rank, 10 * rank + 1]), group)  # doctest: +SKIP
        tensor([0, 10])  # on rank 0 of a 2-rank group; tensor([1, 11]) on rank 1
    """
    size, rank = _size_and_rank(group)
    _check_leading("all_to_all", tensor, size)
    source = _physical(tensor)
    if size == 1:
        return _dense_copy(source)
    if async_op:
        pending = _issue_async(
            "all_to_all", group, lambda g: funcol.all_to_all_single(source.view(-1), None, None, g)
        )
        if pending is not None:
            return pending.view(source.shape)

    def native() -> torch.Tensor:
        out = torch.empty_like(source)
        dist.all_to_all_single(out.view(-1), source.view(-1), group=group)
        return out

    def fallback() -> torch.Tensor:
        return all_gather(source, group)[:, rank].clone()

    return _native_or_fallback("all_to_all_single", group, native, fallback)


@_reports_lost_peers
def all_to_all_single(
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: ProcessGroup | None,
) -> torch.Tensor:
    """Send rows ``input_split_sizes[i]`` of ``tensor`` (dim 0) to group-rank ``i``; uneven splits.

    The result holds ``output_split_sizes[j]`` rows from group-rank ``j``, in group-rank
    order (the routed tokens of a mixture of experts, for example).

    Example::

        >>> all_to_all_single(torch.arange(3.0), [1, 1], [1, 2], group)  # doctest: +SKIP
        tensor([0., 10.])  # on rank 0 when rank 1 sent tensor([10., 11., 12.]) as [1, 2]
    """
    size, _ = _size_and_rank(group)
    if len(input_split_sizes) != size or len(output_split_sizes) != size:
        raise ValueError(
            f"all_to_all_single: expected {size} input and output split sizes (the group "
            f"size), found {len(input_split_sizes)} and {len(output_split_sizes)}"
        )
    if sum(input_split_sizes) != tensor.shape[0]:
        raise ValueError(
            f"all_to_all_single: input split sizes {list(input_split_sizes)} sum to "
            f"{sum(input_split_sizes)}, but the tensor has {tensor.shape[0]} rows"
        )
    source = _physical(tensor)
    if size == 1:
        return _dense_copy(source)
    out = source.new_empty((sum(output_split_sizes), *source.shape[1:]))
    dist.all_to_all_single(
        out,
        source,
        output_split_sizes=list(output_split_sizes),
        input_split_sizes=list(input_split_sizes),
        group=group,
    )
    return out


@_reports_lost_peers
def broadcast(tensor: torch.Tensor, group: ProcessGroup | None, src: int) -> torch.Tensor:
    """Group-rank ``src``'s ``tensor`` on every rank, as a new tensor.

    Every rank passes a tensor of the same shape and dtype; only ``src``'s values
    are read. The result never aliases the input, on any rank.

    Example::

        >>> broadcast(torch.tensor([rank]), group, src=1)  # doctest: +SKIP
        tensor([1])  # on every rank
    """
    size, _ = _size_and_rank(group)
    _check_src("broadcast", src, size)
    out = _dense_copy(tensor)
    if size > 1:
        dist.broadcast(out, src=_global_rank(group, src), group=group)
    return out


@_reports_lost_peers
def scatter(
    chunks: list[torch.Tensor] | None,
    like: torch.Tensor,
    group: ProcessGroup | None,
    src: int,
) -> torch.Tensor:
    """Group-rank ``src`` sends ``chunks[i]`` to group-rank ``i``; each rank gets its chunk.

    ``src`` passes ``group_size`` chunks shaped like ``like``; other ranks pass
    ``None`` (ignored if given). ``like`` gives every rank the chunk's shape,
    dtype and device (its values are not read).

    Example::

        >>> chunks = list(torch.arange(4.0).chunk(2)) if rank == 0 else None  # doctest: +SKIP
        >>> scatter(chunks, torch.empty(2), group, src=0)  # doctest: +SKIP
        tensor([2., 3.])  # on rank 1
    """
    size, rank = _size_and_rank(group)
    _check_src("scatter", src, size)
    sources: list[torch.Tensor] | None = None
    if rank == src:
        if chunks is None or len(chunks) != size:
            found = "None" if chunks is None else f"{len(chunks)} chunks"
            raise ValueError(f"scatter: src rank {src} must pass {size} chunks, got {found}")
        for index, chunk in enumerate(chunks):
            if chunk.shape != like.shape or chunk.dtype != like.dtype:
                raise ValueError(
                    f"scatter: chunk {index} has shape {tuple(chunk.shape)} and dtype "
                    f"{chunk.dtype}; expected {tuple(like.shape)} and {like.dtype} (from like)"
                )
        sources = [_physical(chunk) for chunk in chunks]
    if size == 1:
        assert sources is not None
        return _dense_copy(sources[0])
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.scatter(out, sources, src=_global_rank(group, src), group=group)
    return out

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

Process groups live in ``_comm_groups``, the errors of a failed collective in
``_comm_errors``; both are re-exported here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from hyper_parallel.platform_torch._comm_errors import (
    CollectiveError,
    CollectiveTimeoutError,
    PeerLostError,
    _reports_lost_peers,
)
from hyper_parallel.platform_torch._comm_groups import (
    default_group_timeout,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)

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

# (backend, collective) pairs a backend refused as unsupported; see the module docstring.
_UNSUPPORTED: set[tuple[str, str]] = set()


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

"""Collectives over a mesh axis: the one caller of the platform's collectives, and their record.

Every collective hyper-parallel issues (redistribution, the in-kernel reductions of
sharding rules, ``distribute_tensor``, hp-dmodule's data-parallel gradient averaging)
goes through a function here. Each call names a mesh and a mesh axis; the group is that
axis's process group of this rank, and positions (``src``, the stacking order of
results) are this rank's local ranks along the axis (``mesh.get_local_rank(axis)``).
Each call is reported to the observers active in this context
(:func:`observe_collectives`, which :class:`~hyper_parallel.dtensor.CommDebugMode`
uses) as a :class:`CollectiveRecord`: the kind, this rank's input bytes, the group
size and the mesh axis.

Like the platform's collectives they are out of place: they return new tensors and
leave their inputs untouched. ``async_op=True`` (all-gather, all-reduce, reduce-scatter,
all-to-all) issues the collective and returns at once; the first op that reads the
result (or :func:`wait`) waits for it. The record is made when the collective is issued. Every rank of the axis's group must call them in the same
order with the same shapes.

Example::

    from hyper_parallel.dtensor import collectives, init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    total = collectives.all_reduce(torch.ones(3), mesh, "tp", "sum")   # tensor([2., 2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.platform import ReduceOpName, get_platform

__all__ = [
    "CollectiveRecord",
    "Observer",
    "all_gather",
    "all_reduce",
    "all_reduce_over",
    "all_to_all",
    "all_to_all_single",
    "any_rank",
    "broadcast",
    "issued_here",
    "observe_collectives",
    "reduce_scatter",
    "scatter",
    "send_recv",
    "wait",
]

Axis = int | str


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    ``kind``: ``"all_gather"``, ``"all_reduce"``, ``"reduce_scatter"``, ``"all_to_all"``,
    ``"broadcast"``, ``"scatter"`` or ``"send_recv"``; ``nbytes``: this rank's input bytes (for a scatter:
    one chunk); ``group_size``: ranks in the group; ``mesh_axis``: the axis's name, or
    its index on a mesh without names (for a functional collective of compiled code on a
    group no live mesh holds, ``CommDebugMode`` gives the group's name).

    Example::

        CollectiveRecord("all_reduce", nbytes=64, group_size=2, mesh_axis="tp")
    """

    kind: str
    nbytes: int
    group_size: int
    mesh_axis: Axis


Observer = Callable[[CollectiveRecord], None]
"""Called with the record of each collective issued while it observes."""

_observers: ContextVar[tuple[Observer, ...]] = ContextVar("hp_collective_observers", default=())
# True while the platform issues a collective this module has reported (see ``_issue``)
_issuing: ContextVar[bool] = ContextVar("hp_issuing_collective", default=False)


@contextmanager
def observe_collectives(observer: Observer) -> Iterator[None]:
    """Call ``observer`` with the record of every collective issued in this context.

    Observers nest: an outer one keeps seeing collectives while an inner one is active.

    Example::

        records: list[CollectiveRecord] = []
        with observe_collectives(records.append):
            dt.full_tensor()
        [r.kind for r in records]   # ['all_gather']
    """
    token = _observers.set((*_observers.get(), observer))
    try:
        yield
    finally:
        _observers.reset(token)


def _issue(
    kind: str,
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    axis: Axis,
    size: int,
    call: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """Report one collective to the observers, then ``call`` the platform to issue it.

    While observed, the platform's call runs marked as hp's (:func:`issued_here`), so an
    observer that also watches torch's functional collectives does not count it twice.
    """
    observers = _observers.get()
    if not observers:
        return call()
    index = mesh.axis_index(axis)
    names = mesh.mesh_dim_names
    record = CollectiveRecord(
        kind,
        tensor.numel() * tensor.element_size(),
        size,
        names[index] if names is not None else index,
    )
    for observer in observers:
        observer(record)
    token = _issuing.set(True)
    try:
        return call()
    finally:
        _issuing.reset(token)


def issued_here() -> bool:
    """True while this module's collective is being issued by the platform (already reported).

    Example::

        issued_here()   # False outside a call of this module
    """
    return _issuing.get()


def all_gather(
    tensor: torch.Tensor, mesh: DeviceMesh, axis: Axis, *, async_op: bool = False
) -> torch.Tensor:
    """Every rank's ``tensor`` along ``axis``, stacked in local-rank order: ``(size, *shape)``.

    Example::

        stacked = all_gather(torch.tensor([mesh.get_local_rank("tp")]), mesh, "tp")  # [[0], [1]]
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "all_gather",
        tensor,
        mesh,
        axis,
        size,
        lambda: get_platform().all_gather(tensor, group, async_op=async_op),
    )


def all_reduce(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    axis: Axis,
    reduce_op: ReduceOpName = "sum",
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Element-wise reduction of every rank's ``tensor`` along ``axis`` ("avg": floating dtypes).

    Example::

        total = all_reduce(torch.ones(3), mesh, "tp")   # tensor([2., 2., 2.]) on 2 ranks
        pending = all_reduce(grad, mesh, "tp", async_op=True)   # overlap with other work
        grad = wait(pending)
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "all_reduce",
        tensor,
        mesh,
        axis,
        size,
        lambda: get_platform().all_reduce(tensor, group, reduce_op, async_op=async_op),
    )


def all_reduce_over(
    tensor: torch.Tensor, mesh: DeviceMesh, axes: Sequence[Axis], reduce_op: ReduceOpName
) -> torch.Tensor:
    """All-reduce ``tensor`` along each of ``axes`` in turn (the reduction over their product).

    Example::

        total = all_reduce_over(torch.ones(1), mesh, ("dp", "tp"), "sum")   # the world size
    """
    for axis in axes:
        tensor = all_reduce(tensor, mesh, axis, reduce_op)
    return tensor


def reduce_scatter(
    stacked: torch.Tensor,
    mesh: DeviceMesh,
    axis: Axis,
    reduce_op: ReduceOpName = "sum",
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """Reduce ``(size, *chunk)`` inputs along ``axis``; this rank gets its ``chunk``.

    Example::

        mine = reduce_scatter(torch.ones(2, 3), mesh, "tp")   # tensor([2., 2., 2.]) on 2 ranks
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "reduce_scatter",
        stacked,
        mesh,
        axis,
        size,
        lambda: get_platform().reduce_scatter(stacked, group, reduce_op, async_op=async_op),
    )


def all_to_all(
    stacked: torch.Tensor, mesh: DeviceMesh, axis: Axis, *, async_op: bool = False
) -> torch.Tensor:
    """Slot ``i`` of ``(size, *chunk)`` goes to local rank ``i``; slot ``j`` of the result came from ``j``.

    Example::

        exchanged = all_to_all(torch.arange(2).view(2, 1), mesh, "tp")
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "all_to_all",
        stacked,
        mesh,
        axis,
        size,
        lambda: get_platform().all_to_all(stacked, group, async_op=async_op),
    )


def all_to_all_single(
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    mesh: DeviceMesh,
    axis: Axis,
) -> torch.Tensor:
    """Rows ``input_split_sizes[i]`` of ``tensor`` go to local rank ``i``; uneven splits along dim 0.

    The result stacks ``output_split_sizes[j]`` rows from each local rank ``j`` in order.
    Recorded as kind ``"all_to_all"``.

    Example::

        # 2 ranks: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 0 and 1
        got = all_to_all_single(x, [1, 0] if rank == 0 else [2, 1], [1, 2] if rank == 0 else [0, 1],
                                mesh, "ep")
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "all_to_all",
        tensor,
        mesh,
        axis,
        size,
        lambda: get_platform().all_to_all_single(
            tensor, output_split_sizes, input_split_sizes, group
        ),
    )


def send_recv(
    tensor: torch.Tensor, mesh: DeviceMesh, axis: Axis, *, offset: int = 1, async_op: bool = False
) -> torch.Tensor:
    """A ring shift along ``axis``: send ``tensor`` to local rank ``rank + offset``, get ``rank - offset``'s.

    Point-to-point sends and receives (context parallelism's ring attention); recorded
    as kind ``"send_recv"`` with the bytes sent. ``async_op=True`` returns at once and
    :func:`wait` waits, so the next transfer overlaps the current compute.

    Example::

        previous = send_recv(torch.tensor([mesh.get_local_rank("cp")]), mesh, "cp")  # [1] on 0 of 2
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "send_recv",
        tensor,
        mesh,
        axis,
        size,
        lambda: get_platform().send_recv(tensor, group, offset=offset, async_op=async_op),
    )


def wait(tensor: torch.Tensor) -> torch.Tensor:
    """The values of an ``async_op=True`` collective's result, waited for; any other tensor as is.

    Example::

        pending = all_reduce(grad, mesh, "tp", async_op=True)
        weight_grad = grad_out.t() @ x          # runs while the all-reduce is in flight
        grad = wait(pending)
    """
    return get_platform().wait(tensor)


def broadcast(tensor: torch.Tensor, mesh: DeviceMesh, axis: Axis, src: int = 0) -> torch.Tensor:
    """Local rank ``src``'s ``tensor`` on every rank along ``axis`` (a new tensor).

    Ranks other than ``src`` pass a tensor of the same shape and dtype (its values are unused).

    Example::

        value = broadcast(torch.tensor([mesh.get_local_rank("tp")]), mesh, "tp", 0)  # [0]
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "broadcast", tensor, mesh, axis, size, lambda: get_platform().broadcast(tensor, group, src)
    )


def scatter(
    chunks: list[torch.Tensor] | None,
    like: torch.Tensor,
    mesh: DeviceMesh,
    axis: Axis,
    src: int = 0,
) -> torch.Tensor:
    """Local rank ``src`` sends ``chunks[i]`` to local rank ``i`` along ``axis``.

    ``like`` gives every chunk's shape and dtype; ranks other than ``src`` pass ``None``.

    Example::

        mine = scatter([torch.zeros(2), torch.ones(2)] if rank == 0 else None,
                       torch.empty(2), mesh, "tp", 0)
    """
    size, group = mesh._size_and_group(axis)
    return _issue(
        "scatter", like, mesh, axis, size, lambda: get_platform().scatter(chunks, like, group, src)
    )


def any_rank(flag: bool, mesh: DeviceMesh, device: torch.device | str = "cpu") -> bool:
    """True on every rank of ``mesh`` when ``flag`` is true on any of them (a collective).

    Lets every rank learn that one rank found a problem, so that none is left waiting
    in a later collective.

    Example::

        if any_rank(problem is not None, mesh):
            raise ValueError("a rank found a problem")
    """
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    axes = [axis for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    return bool(all_reduce_over(value, mesh, axes, "max").item())

"""The ``Platform`` protocol: everything hyper-parallel needs from a framework, and no more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["Platform", "ReduceOpName"]

ReduceOpName = Literal["sum", "avg", "product", "max", "min"]


@runtime_checkable
class Platform(Protocol):
    """A framework adapter: tensor types, devices, process groups and collectives.

    All collectives are *out of place* (they return new tensors and leave their
    inputs untouched), accept non-contiguous inputs, and use *group-local* ranks:
    ``src`` and the stacking order of results are positions in the ``ranks``
    list given to :meth:`new_group`. Every rank of ``group`` must call a
    collective in the same order with the same shapes. ``group=None`` means the
    default (world) group.

    Example::

        >>> from hyper_parallel.platform import get_platform
        >>> platform = get_platform()
        >>> platform.device_for("cpu")
        device(type='cpu')
    """

    #: Short name under which the adapter is registered (``"torch"``).
    name: str
    #: The framework's module base class (``torch.nn.Module``).
    Module: type[torch.nn.Module]
    #: The framework's parameter class (``torch.nn.Parameter``).
    Parameter: type[torch.nn.Parameter]

    # -- devices ---------------------------------------------------------------
    def device_for(self, device_type: str) -> torch.device:
        """This process's device of ``device_type`` (accelerators: ``LOCAL_RANK % count``)."""
        ...

    def ensure_device_type(self, device_type: str) -> None:
        """Check ``device_type`` is supported and usable here (npu: import torch_npu), else raise clearly."""
        ...

    def rng_is_sequential(self, device: torch.device) -> bool:
        """True when ``device``'s generator is one stream that kernels consume in element order.

        Then a random fill of ``N`` elements equals fills of consecutive pieces, and
        hp-dtensor draws a sharded tensor's fill in bounded pieces (torch's CPU Mersenne
        Twister). False for counter-based generators (CUDA and NPU Philox), whose
        element-to-draw mapping follows the kernel's launch grid: the full tensor is
        drawn at once and sliced.
        """
        ...

    # -- process groups --------------------------------------------------------
    def is_initialized(self) -> bool:
        """True once the default process group of this process exists."""
        ...

    def init_process_group(self, device_type: str, *, timeout_s: float = 300.0) -> None:
        """Create the default process group from ``RANK``/``WORLD_SIZE``/``MASTER_*`` (env://)."""
        ...

    def get_rank(self) -> int:
        """Global rank of this process in the default group."""
        ...

    def get_world_size(self) -> int:
        """Number of processes in the default group."""
        ...

    def new_group(self, ranks: Sequence[int], *, description: str | None = None) -> ProcessGroup:
        """A process group over global ``ranks``; group-rank ``i`` is ``ranks[i]``.

        Collective: every rank of the world calls it, in the same order, with the
        same ``ranks``. On ranks not in ``ranks`` the result is a placeholder that
        must not be used. ``description`` names the group in errors (a mesh axis).
        """
        ...

    # -- collectives (out of place, group-local ranks) -------------------------
    # ``async_op=True`` (all_gather, all_reduce, reduce_scatter, all_to_all): the collective
    # is issued and the call returns at once; the result may be a tensor whose values are
    # waited for by the first op that reads them, or by :meth:`wait` (torch: an
    # ``AsyncCollectiveTensor``). Every other part of the contract holds.
    def all_gather(
        self, tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
    ) -> torch.Tensor:
        """Stack every rank's ``tensor`` in group-rank order: shape ``(group_size, *shape)``."""
        ...

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        reduce_op: ReduceOpName,
        *,
        async_op: bool = False,
    ) -> torch.Tensor:
        """Element-wise reduction of every rank's ``tensor`` ("avg" needs a floating dtype)."""
        ...

    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        reduce_op: ReduceOpName,
        *,
        async_op: bool = False,
    ) -> torch.Tensor:
        """Reduce ``(group_size, *chunk)`` inputs across ranks; return this rank's ``chunk``."""
        ...

    def all_to_all(
        self, tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
    ) -> torch.Tensor:
        """Input slot ``i`` goes to group-rank ``i``; output slot ``j`` came from group-rank ``j``."""
        ...

    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        """Rows ``input_split_sizes[i]`` of ``tensor`` (dim 0) go to group-rank ``i``; uneven splits."""
        ...

    def send_recv(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        *,
        offset: int = 1,
        async_op: bool = False,
    ) -> torch.Tensor:
        """A ring shift: send ``tensor`` to group-rank ``rank + offset``, return what
        ``rank - offset`` sent (point-to-point; ``async_op``: :meth:`wait` waits)."""
        ...

    def wait(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values of an ``async_op=True`` result, waited for (any other tensor: itself)."""
        ...

    def broadcast(self, tensor: torch.Tensor, group: ProcessGroup | None, src: int) -> torch.Tensor:
        """Group-rank ``src``'s ``tensor`` on every rank (a new tensor, never the input)."""
        ...

    def scatter(
        self,
        chunks: list[torch.Tensor] | None,
        like: torch.Tensor,
        group: ProcessGroup | None,
        src: int,
    ) -> torch.Tensor:
        """Group-rank ``src`` sends ``chunks[i]`` to group-rank ``i``; ``like`` gives shape/dtype."""
        ...

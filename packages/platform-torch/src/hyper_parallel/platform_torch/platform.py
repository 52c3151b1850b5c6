"""``TorchPlatform``: the ``hyper_parallel.platform.Platform`` protocol implemented with torch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from hyper_parallel.platform_torch import comm, devices
from hyper_parallel.platform_torch.comm import ReduceOpName

__all__ = ["TorchPlatform"]


class TorchPlatform:
    """PyTorch adapter: CPU (gloo), CUDA (nccl), Ascend NPU (hccl, via torch_npu).

    Stateless; every instance behaves the same. It satisfies the
    ``hyper_parallel.platform.Platform`` protocol structurally (it does not import it).

    Example::

        >>> platform = TorchPlatform()
        >>> platform.name, platform.rng_is_sequential(torch.device("cpu"))
        ('torch', True)
    """

    name: str = "torch"
    Module: type[torch.nn.Module] = torch.nn.Module
    Parameter: type[torch.nn.Parameter] = torch.nn.Parameter

    def __repr__(self) -> str:
        return "TorchPlatform()"

    # -- devices ---------------------------------------------------------------
    def device_for(self, device_type: str) -> torch.device:
        """This process's device of ``device_type`` (accelerators: ``LOCAL_RANK % count``)."""
        return devices.device_for(device_type)

    def ensure_device_type(self, device_type: str) -> None:
        """Raise a clear error unless ``device_type`` works here (npu: imports torch_npu)."""
        devices.ensure_device_type(device_type)

    def rng_is_sequential(self, device: torch.device) -> bool:
        """CPU: one Mersenne-Twister stream; CUDA/NPU: counter-based Philox (not sequential)."""
        return devices.rng_is_sequential(device)

    # -- process groups --------------------------------------------------------
    def is_initialized(self) -> bool:
        """True once the default process group exists."""
        return comm.is_initialized()

    def init_process_group(self, device_type: str, *, timeout_s: float = 300.0) -> None:
        """Create the default process group by env:// rendezvous."""
        comm.init_process_group(device_type, timeout_s=timeout_s)

    def get_rank(self) -> int:
        """Global rank of this process."""
        return comm.get_rank()

    def get_world_size(self) -> int:
        """Number of processes in the default group."""
        return comm.get_world_size()

    def new_group(self, ranks: Sequence[int], *, description: str | None = None) -> ProcessGroup:
        """A process group whose group-rank ``i`` is ``ranks[i]`` (collective call)."""
        return comm.new_group(ranks, description=description)

    # -- collectives -----------------------------------------------------------
    def all_gather(
        self, tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
    ) -> torch.Tensor:
        """Stack every rank's ``tensor`` in group-rank order."""
        return comm.all_gather(tensor, group, async_op=async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        reduce_op: ReduceOpName,
        *,
        async_op: bool = False,
    ) -> torch.Tensor:
        """Element-wise reduction across the group (out of place)."""
        return comm.all_reduce(tensor, group, reduce_op, async_op=async_op)

    def reduce_scatter(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        reduce_op: ReduceOpName,
        *,
        async_op: bool = False,
    ) -> torch.Tensor:
        """Reduce ``(group_size, *chunk)`` inputs; return this rank's chunk."""
        return comm.reduce_scatter(tensor, group, reduce_op, async_op=async_op)

    def all_to_all(
        self, tensor: torch.Tensor, group: ProcessGroup | None, *, async_op: bool = False
    ) -> torch.Tensor:
        """Exchange slot ``i`` of every rank's input with group-rank ``i``."""
        return comm.all_to_all(tensor, group, async_op=async_op)

    def all_to_all_single(
        self,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        """Send ``input_split_sizes[i]`` rows to group-rank ``i``; receive ``output_split_sizes[j]`` from ``j``."""
        return comm.all_to_all_single(tensor, output_split_sizes, input_split_sizes, group)

    def send_recv(
        self,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        *,
        offset: int = 1,
        async_op: bool = False,
    ) -> torch.Tensor:
        """Send to group rank ``rank + offset``; return what ``rank - offset`` sent (point-to-point)."""
        return comm.send_recv(tensor, group, offset=offset, async_op=async_op)

    def wait(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values of an ``async_op=True`` result (an ``AsyncCollectiveTensor``), waited for."""
        return comm.wait(tensor)

    def broadcast(self, tensor: torch.Tensor, group: ProcessGroup | None, src: int) -> torch.Tensor:
        """Group-rank ``src``'s ``tensor`` on every rank (a new tensor)."""
        return comm.broadcast(tensor, group, src)

    def scatter(
        self,
        chunks: list[torch.Tensor] | None,
        like: torch.Tensor,
        group: ProcessGroup | None,
        src: int,
    ) -> torch.Tensor:
        """Group-rank ``src`` sends ``chunks[i]`` to group-rank ``i``."""
        return comm.scatter(chunks, like, group, src)

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
        >>> platform.name, platform.backend_for("cuda"), platform.is_tensor(torch.ones(1))
        ('torch', 'nccl', True)
    """

    name: str = "torch"
    Module: type[torch.nn.Module] = torch.nn.Module
    Parameter: type[torch.nn.Parameter] = torch.nn.Parameter
    Tensor: type[torch.Tensor] = torch.Tensor

    def __repr__(self) -> str:
        return "TorchPlatform()"

    def is_tensor(self, obj: object) -> bool:
        """True for ``torch.Tensor`` instances, parameters and tensor subclasses included."""
        return isinstance(obj, torch.Tensor)

    # -- devices ---------------------------------------------------------------
    def backend_for(self, device_type: str) -> str:
        """cpu→gloo, cuda→nccl, npu→hccl; ``ValueError`` naming the supported types otherwise."""
        return devices.backend_for(device_type)

    def device_for(self, device_type: str) -> torch.device:
        """This process's device of ``device_type`` (accelerators: ``LOCAL_RANK % count``)."""
        return devices.device_for(device_type)

    def ensure_device_type(self, device_type: str) -> None:
        """Raise a clear error unless ``device_type`` works here (npu: imports torch_npu)."""
        devices.ensure_device_type(device_type)

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        """A copy of the random generator state of ``device``."""
        return devices.get_rng_state(device)

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        """Restore the random generator state of ``device``."""
        devices.set_rng_state(state, device)

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

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup:
        """A process group whose group-rank ``i`` is ``ranks[i]`` (collective call)."""
        return comm.new_group(ranks)

    # -- collectives -----------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """Stack every rank's ``tensor`` in group-rank order."""
        return comm.all_gather(tensor, group)

    def all_reduce(
        self, tensor: torch.Tensor, group: ProcessGroup | None, reduce_op: ReduceOpName
    ) -> torch.Tensor:
        """Element-wise reduction across the group (out of place)."""
        return comm.all_reduce(tensor, group, reduce_op)

    def reduce_scatter(
        self, tensor: torch.Tensor, group: ProcessGroup | None, reduce_op: ReduceOpName
    ) -> torch.Tensor:
        """Reduce ``(group_size, *chunk)`` inputs; return this rank's chunk."""
        return comm.reduce_scatter(tensor, group, reduce_op)

    def all_to_all(self, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """Exchange slot ``i`` of every rank's input with group-rank ``i``."""
        return comm.all_to_all(tensor, group)

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

"""``ParallelStyle``, the base of every parallel style, and the 1-D mesh check styles share."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement

__all__ = ["Layouts", "ParallelStyle"]

Layouts = tuple[Placement | None, ...]


class ParallelStyle(ABC):
    """How :func:`parallelize_module` parallelizes one module (subclass it for a custom style).

    ``src_data_rank`` is the rank whose values ``distribute_tensor`` scatters
    (``parallelize_module`` sets it); ``None``: each rank slices its own copy.

    Example::

        class Replicated(ParallelStyle):
            def _apply(self, module, device_mesh):
                return distribute_module(module, device_mesh)
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...

    def _check(self, module: nn.Module, device_mesh: DeviceMesh, where: str) -> None:  # noqa: B027
        """Raise if this style cannot be applied to ``module`` (called before any change).

        Optional for a custom style: the default accepts every module.
        """


def _check_1d(style: ParallelStyle, mesh: DeviceMesh, where: str) -> None:
    if mesh.ndim != 1:
        names = f" {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        raise ValueError(
            f"{type(style).__name__} on {where}: expected a 1-D DeviceMesh, found a "
            f"{mesh.ndim}-D mesh{names}; pass a slice of it, e.g. mesh['tp']"
        )

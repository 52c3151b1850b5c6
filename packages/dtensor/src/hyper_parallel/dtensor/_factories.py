"""DTensor factories with torch's names: ``ones``, ``zeros``, ``full``, ``empty``, ``rand``, ``randn``.

Each rank allocates only its shard. ``rand``/``randn`` give each rank exactly its
slice of what the same call gives on one device after the same ``torch.manual_seed``
(they fill through the DTensor random ops).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from hyper_parallel.dtensor._autograd import ensure_leaf_grad_hook
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_strides,
    local_shape_and_offset,
    normalize_placements,
)
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.dtensor.placement_types import Placement, Replicate
from hyper_parallel.platform import get_platform

__all__ = ["Factory", "empty", "full", "ones", "rand", "randn", "zeros"]

Size = int | Sequence[int] | torch.Size


def _size(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


def _make(
    name: str,
    size: tuple[Any, ...],
    local_init: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
    *,
    dtype: torch.dtype | None,
    requires_grad: bool,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
) -> DTensor:
    shape = _size(size)
    mesh = device_mesh if device_mesh is not None else current_mesh(name)
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    placements_t = normalize_placements(placements, mesh.ndim, len(shape), where=name)
    dtype = dtype or torch.get_default_dtype()
    device = get_platform().device_for(mesh.device_type)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        local = torch.empty(0, dtype=dtype, device=device)
    else:
        local_shape, _ = local_shape_and_offset(shape, mesh.shape, coordinate, placements_t)
        local = local_init(local_shape, dtype, device)
    spec = DTensorSpec(mesh, placements_t, TensorMeta(shape, contiguous_strides(shape), dtype))
    result = DTensor(local, spec, requires_grad=requires_grad)
    ensure_leaf_grad_hook(result)
    return result


class Factory(Protocol):
    """The signature of ``ones``, ``zeros``, ``empty``, ``rand`` and ``randn``."""

    def __call__(
        self,
        *size: Any,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor: ...


def _factory(
    name: str,
    local_init: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
    doc: str,
) -> Factory:
    def factory(
        *size: Any,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        return _make(
            name,
            size,
            local_init,
            dtype=dtype,
            requires_grad=requires_grad,
            device_mesh=device_mesh,
            placements=placements,
        )

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


def _drawn(name: str, fill: str, doc: str) -> Factory:
    """A random factory: an empty DTensor filled in place by the DTensor random op ``fill``."""

    def factory(
        *size: Any,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        out = empty(*size, dtype=dtype, device_mesh=device_mesh, placements=placements)
        with torch.no_grad():
            getattr(out, fill)()
        return out.requires_grad_(requires_grad) if requires_grad else out

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


ones = _factory(
    "ones",
    lambda s, d, dev: torch.ones(s, dtype=d, device=dev),
    """A DTensor of ones of global shape ``size``.

    Example::

        w = ones(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """,
)
zeros = _factory(
    "zeros",
    lambda s, d, dev: torch.zeros(s, dtype=d, device=dev),
    """A DTensor of zeros of global shape ``size``.

    Example::

        w = zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """,
)
empty = _factory(
    "empty",
    lambda s, d, dev: torch.empty(s, dtype=d, device=dev),
    """An uninitialised DTensor of global shape ``size``.

    Example::

        w = empty(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """,
)
rand = _drawn(
    "rand",
    "uniform_",
    """Uniform ``[0, 1)`` values: this rank's slice of ``torch.rand(size)`` on one device.

    Example::

        torch.manual_seed(0); w = rand(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """,
)
randn = _drawn(
    "randn",
    "normal_",
    """Standard normal values: this rank's slice of ``torch.randn(size)`` on one device.

    Example::

        torch.manual_seed(0); w = randn(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """,
)


def full(
    size: Size,
    fill_value: float,
    *,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """A DTensor of global shape ``size`` filled with ``fill_value``.

    Example::

        w = full((8, 4), 0.5, device_mesh=mesh, placements=[Shard(0)])
    """
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    return _make(
        "full",
        (size,),
        lambda s, d, dev: torch.full(s, fill_value, dtype=d, device=dev),
        dtype=dtype,
        requires_grad=requires_grad,
        device_mesh=device_mesh,
        placements=placements,
    )

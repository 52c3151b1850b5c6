"""The fallback for ops without a usable rule: gather to Replicate, run on full tensors.

Always correct, never fast: it warns once per op (:class:`FallbackWarning`) and
counts every call (:func:`fallback_counts`). Outputs are Replicate; a DTensor the
op writes in place gets its new value back in its own layout (a Partial one
becomes Replicate).
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch

from hyper_parallel.dtensor._api import DTensor, _local_slice
from hyper_parallel.dtensor._planning import _WRAP, _aliased_result, _OpInfo, _Plan, _swap_all
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Replicate

__all__ = ["FallbackWarning", "fallback_counts", "reset_fallback_counts"]


class FallbackWarning(UserWarning):
    """An op ran through the gather-compute-replicate fallback (correct, but slow)."""


_fallbacks: Counter[str] = Counter()


def fallback_counts() -> dict[str, int]:
    """How many times each op has fallen back since the process started (or the last reset).

    Example::

        before = fallback_counts()
    """
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    """Forget the fallback counts.

    Example::

        reset_fallback_counts(); y = torch.sort(dt); fallback_counts()  # {'aten.sort.default': 1}
    """
    _fallbacks.clear()


def _run_fallback(
    info: _OpInfo,
    plan: _Plan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtensors: list[DTensor],
) -> Any:
    func = info.func
    name = str(func)
    _fallbacks[name] += 1
    if _fallbacks[name] == 1:
        warnings.warn(
            f"hyper_parallel.dtensor: {name} ran on full tensors (gathered to Replicate) and "
            f"returned Replicate because {plan.reason}. Correct, but it communicates and "
            "computes the whole tensor on every rank.",
            FallbackWarning,
            stacklevel=4,
        )
    if not dtensors:
        return func(*args, **kwargs)
    mesh = dtensors[0]._spec.mesh
    for dt in dtensors[1:]:
        if dt._spec.mesh != mesh:
            raise ValueError(
                f"{func}: DTensor arguments live on different meshes: {mesh} and {dt._spec.mesh}"
            )
    replicate = (Replicate(),) * mesh.ndim
    fulls = [redistribute_local(dt._local_tensor, dt._spec, replicate) for dt in dtensors]
    full_args, full_kwargs = _swap_all(args, kwargs, fulls)
    out = func(*full_args, **full_kwargs)
    for i in plan.mutated:
        _write_back(dtensors[i], fulls[i])
    if plan.result == _WRAP:
        return _wrap_replicated(out, mesh)
    return _aliased_result(plan, out, dtensors)


def _write_back(dt: DTensor, full: torch.Tensor) -> None:
    """Give a DTensor the new value of its full tensor, keeping its layout (Partial: Replicate)."""
    spec = dt._spec
    if full is dt._local_tensor:  # replicated: the op wrote its local tensor
        return
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return
    if spec.has_partial():
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        dt._local_tensor = _local_slice(full, mesh, coordinate, placements)
        dt._spec = spec.with_placements(placements)
    else:
        dt._local_tensor.copy_(_local_slice(full, mesh, coordinate, spec.placements))


def _wrap_replicated(out: Any, mesh: DeviceMesh) -> Any:
    if isinstance(out, torch.Tensor):
        meta = TensorMeta(out.shape, out.stride(), out.dtype)
        return DTensor(out, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_replicated(o, mesh) for o in out)
    return out

"""``clip_grad_norm_`` over gradients that live on different meshes (FSDP x TP, replicated).

torch's ``torch.nn.utils.clip_grad_norm_`` stacks the per-gradient norms into one tensor,
which fails when the gradients are DTensors of different meshes (FSDP's ``dp`` mesh, the
joint ``(dp, tp)`` mesh, plain replicated tensors). This one reduces each gradient's
local shard, sums the shards' contributions over the mesh axes that shard it (never over
replicating axes, which would count a value twice), and combines the meshes' totals.
Gradients that backward left Partial (as torch does) are first reduced in place, once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._partial_grads import reduce_partial_grads
from hyper_parallel.dtensor._spec import partial_to_replicate
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement, is_shard_like

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm`` in place; the total norm (a plain tensor).

    The same numbers as ``torch.nn.utils.clip_grad_norm_`` on the full gradients in one
    process, for gradients that are DTensors of any meshes and plain tensors mixed
    (plain tensors count as replicated: each rank holds the whole gradient). Every rank
    of the meshes involved must call it (it all-reduces over their sharding axes).

    Example::

        total = clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    reduce_partial_grads(params)  # Partial gradients left by backward: reduced once, in place
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    inf = norm_type == float("inf")
    by_mesh: dict[tuple[DeviceMesh, tuple[int, ...]] | None, list[torch.Tensor]] = {}
    locals_: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            placements: tuple[Placement, ...] = grad.placements
            # clipped in place, Partial or not: scaling commutes with the reduction
            locals_.append(grad._local_tensor)  # type: ignore[attr-defined]
            if grad._spec.has_partial():  # a Partial parameter's own Partial gradient
                grad = grad.redistribute(grad.device_mesh, partial_to_replicate(placements))
                placements = grad.placements
            local: torch.Tensor = grad._local_tensor  # type: ignore[attr-defined]
            axes = tuple(i for i, p in enumerate(placements) if is_shard_like(p))
            key: tuple[DeviceMesh, tuple[int, ...]] | None = (grad.device_mesh, axes)
        else:
            local, key = grad, None
            locals_.append(local)
        norm = torch.linalg.vector_norm(local.detach(), norm_type)
        by_mesh.setdefault(key, []).append(norm if inf else norm**norm_type)
    device = grads[0].device
    parts: list[torch.Tensor] = []
    for key, norms in by_mesh.items():
        stacked = torch.stack([n.to(device) for n in norms])
        part = stacked.max() if inf else stacked.sum()
        if key is not None:
            mesh, axes = key
            axes = tuple(a for a in axes if mesh.size(a) > 1)
            part = collectives.all_reduce_over(part, mesh, axes, "max" if inf else "sum")
        parts.append(part)
    combined = torch.stack(parts)
    total = combined.max() if inf else combined.sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{float(total)}; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for local in locals_:
            local.mul_(coef.to(local.device, local.dtype))
    return total

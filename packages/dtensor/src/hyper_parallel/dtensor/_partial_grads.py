"""Gradients left Partial by backward, as torch leaves them, and reduced once before a reader.

A replicated parameter used with sharded activations (a norm's weight on batch- or
sequence-sharded inputs) gets a Partial gradient. As torch DTensor, the leaf rule
(``_autograd``) leaves it Partial in ``.grad``: the backward issues no collective and
microbatches accumulate Partial + Partial locally. Unlike torch, whose optimizers then
all-reduce it in every op that reads it, hp reduces it once, in place of ``.grad``, where
the value is first needed:

* ``optimizer.step()`` of any ``torch.optim.Optimizer``: a global step pre-hook, installed
  by the first gradient left Partial (never at import), reduces the optimizer's Partial
  gradients, batching those of one mesh, axes and dtype into one flat all-reduce;
* hp's ``clip_grad_norm_`` (before the norm), and FSDP's gradient reduction;
* anyone else: :func:`reduce_partial_grads` (``p.grad.full_tensor()`` works as well).

Nothing here imports the DTensor class: gradients are rebuilt with their own class.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._spec import DTensorSpec, partial_to_replicate
from hyper_parallel.dtensor.placement_types import Placement, Replicate

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor
    from hyper_parallel.dtensor.device_mesh import DeviceMesh

__all__ = [
    "all_reduce_together",
    "leaf_grad_placements",
    "note_partial_grad",
    "reduce_partial_grads",
]


@functools.lru_cache(maxsize=1024)
def leaf_grad_placements(
    leaf: tuple[Placement, ...], found: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """Where the leaf rule puts a gradient found as ``found`` of a leaf laid out as ``leaf``.

    The leaf's placements, except that a Partial gradient stays Partial on an axis where
    the leaf is Replicate or the same Partial (torch leaves both): it is reduced later,
    once (see the module docstring). A Partial gradient of a Shard leaf is reduce-scattered.

    Example::

        >>> from hyper_parallel.dtensor.placement_types import Partial, Replicate, Shard
        >>> leaf_grad_placements((Replicate(), Shard(0)), (Partial(), Partial()))
        (Partial(reduce_op='sum'), Shard(dim=0))
    """
    return tuple(
        theirs if theirs.is_partial() and (mine.is_replicate() or mine == theirs) else target
        for mine, theirs, target in zip(leaf, found, partial_to_replicate(leaf), strict=True)
    )


class _Pending:
    """How many gradients the leaf rule left Partial so far, and whether the hook is in."""

    count = 0
    hook_installed = False


def note_partial_grad() -> None:
    """Record that backward left a gradient Partial; the first call installs the step hook.

    Example::

        note_partial_grad()   # the leaf rule, after keeping a Partial gradient
    """
    _Pending.count += 1
    if not _Pending.hook_installed:
        # One global step pre-hook, installed by the first Partial gradient (never at import):
        # the one place every optimizer passes before it reads its gradients.
        register_optimizer_step_pre_hook(reduce_before_step)
        _Pending.hook_installed = True


def reduce_before_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Optimizer step pre-hook: reduce the optimizer's Partial gradients, once per backward.

    An optimizer is scanned again only when backward has left a Partial gradient since
    its last scan, so a step without one costs an integer compare.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> reduce_before_step(opt, (), {})
    """
    if optimizer.__dict__.get("_hp_partial_seen") == _Pending.count:
        return
    reduce_partial_grads(p for group in optimizer.param_groups for p in group["params"])
    optimizer.__dict__["_hp_partial_seen"] = _Pending.count


_BatchKey = tuple["DeviceMesh", tuple[tuple[int, str], ...], torch.dtype, torch.device]


def reduce_partial_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Reduce every Partial DTensor gradient of ``parameters`` to its parameter's layout, in place.

    ``p.grad`` becomes a DTensor laid out like ``p`` on the axes where the gradient was
    Partial (a Partial parameter keeps a gradient of its own Partial). Gradients of one
    mesh, reduced axes and dtype are reduced together by one flat all-reduce per axis.
    Every rank of the meshes involved must call it with the same parameters.

    Example::

        reduce_partial_grads(model.parameters())   # after backward: p.grad.placements == p.placements
    """
    batches: dict[_BatchKey, list[tuple[torch.Tensor, DTensor, tuple[Placement, ...]]]] = {}
    for param in parameters:
        grad = param.grad
        spec = getattr(grad, "_spec", None)
        if grad is None or not isinstance(spec, DTensorSpec) or not spec.has_partial():
            continue  # no gradient, a plain one, or a DTensor of another library (torch's)
        found: tuple[Placement, ...] = spec.placements
        mine = getattr(param, "_spec", None)
        want = _reduced(mine.placements if isinstance(mine, DTensorSpec) else found, found)
        if want == found:
            continue
        mesh = spec.mesh
        moved = tuple(
            (axis, str(p.reduce_op))  # type: ignore[attr-defined]
            for axis, (p, q) in enumerate(zip(found, want, strict=True))
            if p != q and mesh.size(axis) > 1
        )
        local: torch.Tensor = grad._local_tensor  # type: ignore[attr-defined]
        simple = all(
            p == q or (p.is_partial() and q.is_replicate())
            for p, q in zip(found, want, strict=True)
        ) and all(op in ("sum", "avg") for _, op in moved)
        if not simple:
            with torch.no_grad():
                moved_local = redistribute_local(local, spec, want)
            param.grad = type(grad)(moved_local, spec.with_placements(want))
            continue
        key = (mesh, moved, local.dtype, local.device)
        batches.setdefault(key, []).append((param, grad, want))  # type: ignore[arg-type]
    for (mesh, moved, _, _), members in batches.items():
        with torch.no_grad():
            locals_ = [g._local_tensor for _, g, _ in members]  # type: ignore[attr-defined]
            reduced = all_reduce_together(locals_, mesh, moved)
            for (param, grad, want), local in zip(members, reduced, strict=True):
                param.grad = type(grad)(local, grad._spec.with_placements(want))


def all_reduce_together(
    tensors: Sequence[torch.Tensor], mesh: DeviceMesh, axes: Sequence[tuple[int, str]]
) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced over ``axes`` (mesh axis, reduce op), all in one flat buffer.

    One all-reduce per axis whatever the number of tensors (the gradients of a step
    pre-hook's batch, the chunks of an FSDP group). Collective over ``mesh``'s axes.

    Example::

        weight_grad, bias_grad = all_reduce_together([weight_grad, bias_grad], mesh, [(0, "sum")])
    """
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0]
    for axis, op in axes:
        flat = collectives.all_reduce(flat, mesh, axis, op)  # type: ignore[arg-type]
    out: list[torch.Tensor] = []
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        out.append(flat.reshape(-1)[offset : offset + n].view(tensor.shape))
        offset += n
    return out


def _reduced(param: tuple[Placement, ...], found: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements of a gradient ``found`` once reduced to the parameter's layout ``param``."""
    return tuple(
        f if not f.is_partial() or f == p else (Replicate() if p.is_partial() else p)
        for p, f in zip(param, found, strict=True)
    )

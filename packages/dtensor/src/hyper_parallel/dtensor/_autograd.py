"""The autograd functions of DTensor's conversions, and where their gradients go.

``from_local``, ``to_local``, ``redistribute`` and ``enforce_layout`` are differentiable
through the functions here; a leaf DTensor that requires grad gets a hook that lays its
incoming gradients out like itself. The gradient rules are torch DTensor's:

* the gradient of a redistribute input is laid out like the input, except that a
  gradient which is not Partial is not turned back into Partial (it stays Replicate);
* the gradient of a leaf has the leaf's placements with Partial made Replicate, except
  that a Partial gradient stays Partial where the leaf is Replicate or that same Partial
  (torch leaves both; ``_partial_grads`` reduces it once, before an optimizer reads it);
* the gradient of ``from_local``'s input is the local part of the leaf layout, Partial
  made Replicate.

Nothing here imports the DTensor class: new DTensors are built with the class of the
tensors at hand, or the one the caller passes in, so the class imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._partial_grads import leaf_grad_placements, note_partial_grad
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._spec import (
    DTensorSpec,
    TensorMeta,
    check_same_mesh,
    contiguous_strides,
    partial_to_replicate,
    replicate_all,
)
from hyper_parallel.dtensor.placement_types import Placement, Replicate

if TYPE_CHECKING:
    from hyper_parallel.dtensor._tensor import DTensor

__all__ = ["FromLocal", "Redistribute", "ToLocal", "ensure_leaf_grad_hook"]

TensorType = type["DTensor"]


def _grad_target(
    forward: tuple[Placement, ...], grad: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """Where the gradient of a redistribute input goes in backward (torch DTensor's rule).

    The forward input's layout, except that a gradient which is not Partial is not
    turned back into the Partial of the forward value: it stays Replicate. So a
    Partial gradient of a Shard or Replicate input is reduced here.
    """
    target: list[Placement] = []
    for fwd, cur in zip(forward, grad, strict=True):
        if fwd.is_partial() and not cur.is_partial():
            target.append(Replicate())
        else:
            target.append(fwd)
    return tuple(target)


def _as_dtensor_grad(tensor_type: TensorType, grad: torch.Tensor, like: DTensorSpec) -> DTensor:
    """A gradient as a DTensor: a plain one of global shape is taken as replicated."""
    if isinstance(grad, tensor_type):
        return grad
    if tuple(grad.shape) == like.shape:
        return tensor_type(grad, like.with_placements(replicate_all(like.mesh.ndim)))
    return tensor_type(grad, like)


def _leaf_grad_hook(
    tensor_type: TensorType, spec: DTensorSpec
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A gradient hook that lays an incoming gradient out like a leaf of layout ``spec``.

    It holds the leaf's spec, not the leaf: no reference cycle, and no weak
    reference (which ``torch.utils.swap_tensors``, used by ``Module.to_empty``, refuses).
    """
    leaf = spec.placements
    target = partial_to_replicate(leaf)

    def to_leaf_layout(grad: torch.Tensor) -> torch.Tensor | None:
        if type(grad) is tensor_type and grad._spec.placements == target:  # type: ignore[attr-defined]
            return None  # the common case, checked without a call: already the leaf's layout
        grad_dt = _as_dtensor_grad(tensor_type, grad, spec)
        found = grad_dt._spec.placements
        want = leaf_grad_placements(leaf, found)
        if want != target:
            note_partial_grad()  # left Partial, as torch: reduced once, before it is read
        if found == want and grad_dt is grad:
            return None  # already laid out like the leaf: nothing to do
        check_same_mesh(grad_dt._spec.mesh, spec.mesh, where="DTensor gradient hook")
        local = redistribute_local(grad_dt._local_tensor, grad_dt._spec, want)
        return tensor_type(local, grad_dt._spec.with_placements(want))

    return to_leaf_layout


def ensure_leaf_grad_hook(dt: DTensor) -> None:
    """Register the layout hook on a leaf that requires grad, once per tensor object.

    Example::

        ensure_leaf_grad_hook(w)   # w: a leaf DTensor with requires_grad=True
    """
    if dt.is_leaf and dt.requires_grad and getattr(dt, "_hp_grad_hook", None) is None:
        hook = _leaf_grad_hook(type(dt), dt._spec)
        dt._hp_grad_hook = dt.register_hook(hook)  # type: ignore[no-untyped-call]


def _broadcast_replicated(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Replicate) and spec.mesh.size(axis) > 1:
            local = collectives.broadcast(local, spec.mesh, axis, 0)
    return local


class FromLocal(torch.autograd.Function):
    """``DTensor.from_local``: wrap a shard; its gradient is the leaf layout's local shard."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, spec: DTensorSpec, run_check: bool, tensor_type: TensorType
    ) -> DTensor:
        ctx.spec = spec
        ctx.tensor_type = tensor_type
        # The broadcast runs inside the Function, so gradients still reach the input.
        value = _broadcast_replicated(local, spec) if run_check else local
        if value is local:
            value = local.view_as(local)
        return tensor_type(value, spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        spec: DTensorSpec = ctx.spec
        grad_dt = _as_dtensor_grad(ctx.tensor_type, grad, spec)
        target = partial_to_replicate(spec.placements)
        local = redistribute_local(grad_dt._local_tensor, grad_dt._spec, target)
        return local, None, None, None


class ToLocal(torch.autograd.Function):
    """``DTensor.to_local``: the shard; its gradient is wrapped as ``grad_placements``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dt: DTensor, grad_placements: tuple[Placement, ...] | None
    ) -> torch.Tensor:
        ctx.spec = dt._spec
        ctx.tensor_type = type(dt)
        ctx.grad_placements = grad_placements
        ctx.grad_spec = None  # the gradient's spec, once known (see backward)
        local = dt._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:  # type: ignore[override]
        # A kept node (hp-dmodule reuses a parameter's local view across steps) runs this
        # every step: its gradient spec is kept on the node, per gradient dtype.
        known: DTensorSpec | None = ctx.grad_spec
        if known is None or known.tensor_meta.dtype is not grad.dtype:
            known = ctx.grad_spec = _grad_spec(ctx.spec, ctx.grad_placements, grad.dtype)
        return ctx.tensor_type(grad, known), None


@functools.lru_cache(maxsize=4096)
def _grad_spec(
    spec: DTensorSpec, grad_placements: tuple[Placement, ...] | None, dtype: torch.dtype
) -> DTensorSpec:
    """The spec of a ``to_local`` gradient: contiguous, laid out as ``grad_placements``."""
    placements = grad_placements or spec.placements
    meta = spec.tensor_meta
    if meta.dtype != dtype or meta.stride != contiguous_strides(meta.shape):
        meta = TensorMeta(meta.shape, contiguous_strides(meta.shape), dtype)
    if placements == spec.placements and meta is spec.tensor_meta:
        return spec
    return DTensorSpec(spec.mesh, placements, meta)


class Redistribute(torch.autograd.Function):
    """``redistribute``/``enforce_layout``: move the shards; backward moves the gradient back.

    ``forward_dtype`` casts the shard before the move (the result has that dtype);
    ``backward_dtype`` casts the gradient before its move, after which it returns to
    the input's dtype (torch's ``redistribute(forward_dtype=, backward_dtype=)``).
    ``async_op``: the forward's collectives are waited for at the result's first use;
    the backward's complete before it returns (the gradient is then a plain shard).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dt: DTensor,
        dst: tuple[Placement, ...],
        forward_dtype: torch.dtype | None,
        backward_dtype: torch.dtype | None,
        async_op: bool = False,
    ) -> DTensor:
        src_spec = dt._spec
        ctx.src_spec = src_spec
        ctx.tensor_type = type(dt)
        ctx.backward_dtype = backward_dtype
        local = dt._local_tensor
        moving = src_spec
        if forward_dtype is not None and forward_dtype != local.dtype:
            local = local.to(forward_dtype)
            moving = _with_dtype(src_spec, forward_dtype)
        local = redistribute_local(local, moving, dst, async_op=async_op)
        if local is dt._local_tensor:
            local = local.view_as(local)
        return type(dt)(local, moving.with_placements(dst), requires_grad=dt.requires_grad)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[DTensor, None, None, None, None]:
        src_spec: DTensorSpec = ctx.src_spec
        tensor_type: TensorType = ctx.tensor_type
        grad_dt = _as_dtensor_grad(tensor_type, grad, src_spec)
        target = _grad_target(src_spec.placements, grad_dt._spec.placements)
        input_dtype = src_spec.tensor_meta.dtype
        moving_dtype = ctx.backward_dtype or input_dtype
        local, spec = grad_dt._local_tensor, grad_dt._spec
        if local.dtype != moving_dtype:
            local, spec = local.to(moving_dtype), _with_dtype(spec, moving_dtype)
        local = redistribute_local(local, spec, target)
        if local.dtype != input_dtype:
            local, spec = local.to(input_dtype), _with_dtype(spec, input_dtype)
        return tensor_type(local, spec.with_placements(target)), None, None, None, None


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, spec.placements, TensorMeta(meta.shape, meta.stride, dtype))

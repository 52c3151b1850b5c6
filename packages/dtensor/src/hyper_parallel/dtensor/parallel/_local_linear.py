"""Column- and row-parallel ``nn.Linear`` forwards on local shards (no per-op dispatch).

A ``ColwiseParallel``/``RowwiseParallel`` ``nn.Linear`` knows its layouts before it
runs: a replicated input times a row shard of the weight is a column shard of the
output; a column shard of the input times a column shard of the weight is a partial
sum. So the linear runs as one ``F.linear`` on the local shards, wrapped back into a
DTensor with those placements, instead of dispatching its ``t``/``view``/``mm`` ops one
by one through the sharding rules: the same values, placements, gradients (a
replicated input's gradient is Partial, reduced where the input became a DTensor) and
collectives, at a fraction of the Python cost. A module whose ``forward`` is not
``nn.Linear``'s, or an input laid out otherwise, takes the ordinary DTensor path.

A column-parallel linear whose replicated input arrives as a plain tensor (this rank's
copy, made for this linear alone) reduces that input's gradient in its own backward,
overlapped with the weight-gradient matmul (Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``): the all-reduce is issued
asynchronously right after the input gradient is computed and waited for once the
weight and bias gradients are done. It is the same all-reduce the input's
``from_local`` would make in backward, moved earlier; :func:`overlap_grad_reduce` turns
it off. A replicated DTensor input may feed several linears: its gradients are summed
and reduced once where it was made, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._spec import contiguous_strides as _strides
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["overlap_grad_reduce", "use_local_linear"]

_overlap: ContextVar[bool] = ContextVar("hp_overlap_grad_reduce", default=True)


@contextmanager
def overlap_grad_reduce(enabled: bool = True) -> Iterator[None]:
    """Whether column-parallel linears made in this context overlap their input-gradient all-reduce.

    On by default. Read when a linear runs forward; the values and collectives are the
    same either way, only when the all-reduce runs differs.

    Example::

        with overlap_grad_reduce(False):   # the all-reduce after the backward matmuls
            loss = model(x).sum()
        loss.backward()
    """
    token = _overlap.set(bool(enabled))
    try:
        yield
    finally:
        _overlap.reset(token)


class _ColwiseOverlapped(torch.autograd.Function):
    """``F.linear`` of a replicated input's copy; backward all-reduces the input gradient
    while the weight and bias gradients are computed (the input gradient leaves reduced)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mesh: DeviceMesh,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.mesh = mesh
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        pending = None
        if ctx.needs_input_grad[0]:
            pending = collectives.all_reduce(grad.matmul(weight), ctx.mesh, 0, async_op=True)
        # while the all-reduce is in flight: the weight and bias gradients
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = collectives.wait(pending) if pending is not None else None
        return grad_x, grad_weight, grad_bias, None


_R: tuple[Placement, ...] = (Replicate(),)
_P: tuple[Placement, ...] = (Partial(),)


def _colwise(module: nn.Linear, x: Any, return_local: bool) -> Any:
    weight: Any = module.weight
    bias: Any = module.bias
    if isinstance(x, DTensor):
        # A replicated DTensor may feed several linears (wq, wk, wv): its Partial gradients
        # are summed and reduced once where it was made, so none is reduced here.
        if x.placements != _R:
            return nn.Linear.forward(module, x)
        mesh = x.device_mesh
        local_x = x.to_local(grad_placements=_P)
    elif isinstance(x, torch.Tensor):
        # A plain input is this rank's copy of a replicated tensor, made for this linear
        # alone (the style's input hook kept it plain): its gradient is reduced here.
        mesh = weight.device_mesh
        if _overlap.get() and torch.is_grad_enabled() and mesh.size() > 1:
            local = _ColwiseOverlapped.apply(
                x, weight.to_local(), bias.to_local() if bias is not None else None, mesh
            )
            return _colwise_output(module, local, x.shape, mesh, return_local)
        local_x = DTensor.from_local(x, mesh, _R).to_local(grad_placements=_P)
    else:
        return nn.Linear.forward(module, x)
    local_bias = bias.to_local() if bias is not None else None
    local = F.linear(local_x, weight.to_local(), local_bias)
    return _colwise_output(module, local, x.shape, mesh, return_local)


def _colwise_output(
    module: nn.Linear,
    local: torch.Tensor,
    input_shape: torch.Size,
    mesh: DeviceMesh,
    return_local: bool,
) -> Any:
    if return_local:  # the style's output hook would only unwrap it again
        return local
    shape = (*input_shape[:-1], module.out_features)
    return DTensor.from_local(
        local, mesh, (Shard(local.ndim - 1),), shape=shape, stride=_strides(shape)
    )


def _rowwise(module: nn.Linear, x: Any) -> Any:
    weight: Any = module.weight
    if isinstance(x, DTensor):
        if x.placements != (Shard(x.ndim - 1),):
            return nn.Linear.forward(module, x)
        x = x.to_local()
    elif not isinstance(x, torch.Tensor):
        return nn.Linear.forward(module, x)
    # a plain input is this rank's shard of the last dim (the style's input hook kept it so)
    mesh = weight.device_mesh
    local = F.linear(x, weight.to_local())
    shape = (*x.shape[:-1], module.out_features)
    y = DTensor.from_local(local, mesh, _P, shape=shape, stride=_strides(shape))
    if module.bias is None:
        return y
    # The bias joins the reduced sum (every rank computes its replicated gradient).
    y = y.redistribute(placements=_R)
    return DTensor.from_local(y.to_local() + module.bias.to_local(), mesh, _R)  # type: ignore[attr-defined]


class _LocalForward:
    """``module.forward`` of a local-shard linear; a plain object, so the module still
    deep-copies (the copy's forward is bound to the copy) and pickles."""

    def __init__(self, module: nn.Linear, kind: str, return_local: bool) -> None:
        self.module = module
        self.kind = kind
        self.return_local = return_local

    def __call__(self, x: Any) -> Any:
        if self.kind == "colwise":
            return _colwise(self.module, x, self.return_local)
        return _rowwise(self.module, x)


def local_linear_applies(module: nn.Module, kind: str, output_layouts: tuple[Any, ...]) -> bool:
    """Whether :func:`use_local_linear` will make ``module`` run on local shards.

    An ``nn.Linear`` with torch's ``forward``; a row-parallel one with a bias only when
    its output is replicated (the bias is added after the sum).
    """
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    return not (kind == "rowwise" and module.bias is not None and output_layouts != _R)


def use_local_linear(
    module: nn.Module, kind: str, output_layouts: tuple[Any, ...], use_local_output: bool
) -> None:
    """Make ``module`` run ``kind`` (``"colwise"``/``"rowwise"``) on local shards, if it applies.

    A column-parallel linear whose output hook would unwrap a ``Shard(-1)`` output
    (``use_local_output``, the default layout) returns the local tensor directly.
    """
    if not local_linear_applies(module, kind, output_layouts):
        return
    assert isinstance(module, nn.Linear)
    return_local = kind == "colwise" and use_local_output and output_layouts == (Shard(-1),)
    module.forward = _LocalForward(module, kind, return_local)  # type: ignore[method-assign,assignment]

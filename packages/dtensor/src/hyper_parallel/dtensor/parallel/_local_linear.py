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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.dtensor._spec import contiguous_strides as _strides
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["use_local_linear"]

_R: tuple[Placement, ...] = (Replicate(),)
_P: tuple[Placement, ...] = (Partial(),)


def _colwise(module: nn.Linear, x: Any, return_local: bool) -> Any:
    if not (isinstance(x, DTensor) and x.placements == _R):
        return nn.Linear.forward(module, x)
    weight, bias = module.weight, module.bias
    local = F.linear(
        x.to_local(grad_placements=_P),
        weight.to_local(),  # type: ignore[attr-defined]
        bias.to_local() if bias is not None else None,  # type: ignore[attr-defined]
    )
    if return_local:  # the style's output hook would only unwrap it again
        return local
    shape = (*x.shape[:-1], module.out_features)
    return DTensor.from_local(
        local, x.device_mesh, (Shard(local.ndim - 1),), shape=shape, stride=_strides(shape)
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

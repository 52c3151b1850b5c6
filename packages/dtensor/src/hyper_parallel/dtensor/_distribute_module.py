"""``distribute_module``: turn a module's parameters and buffers into DTensors, hook its inputs/outputs."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from hyper_parallel.dtensor._distribute import distribute_tensor
from hyper_parallel.dtensor._tensor import DTensor
from hyper_parallel.dtensor.device_mesh import DeviceMesh, current_mesh
from hyper_parallel.dtensor.placement_types import Replicate

__all__ = ["distribute_module"]

PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]
InputFn = Callable[[nn.Module, Any, DeviceMesh], Any]
OutputFn = Callable[[nn.Module, Any, DeviceMesh], Any]


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: PartitionFn | None = None,
    input_fn: InputFn | None = None,
    output_fn: OutputFn | None = None,
) -> nn.Module:
    """Make every parameter and buffer of ``module`` a DTensor and hook its inputs and outputs.

    As ``torch.distributed.tensor.distribute_module``: ``partition_fn(name, submodule,
    mesh)`` runs on every submodule (``name`` as in ``named_modules()``, ``""`` for
    ``module``) and may replace parameters with sharded DTensor parameters; whatever it
    leaves a plain tensor is then replicated over the mesh (broadcast from the first
    rank, as ``distribute_tensor`` does). ``input_fn(module, inputs, mesh)`` becomes a
    forward pre-hook and ``output_fn(module, outputs, mesh)`` a forward hook of
    ``module`` (the deprecated two-argument forms ``(inputs, mesh)`` still work, with a
    ``FutureWarning``). Without ``device_mesh``, the mesh entered with ``with mesh:``.
    A module is distributed once; the same module returns.

    Example::

        def shard_linears(name, mod, mesh):
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(0)]))

        model = distribute_module(
            nn.Sequential(nn.Linear(8, 8)),
            mesh,
            shard_linears,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()]) for x in inputs
            ),
        )
    """
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError(
            f"distribute_module: {type(module).__name__} was already distributed; "
            "distribute_module should only be called once on a module"
        )
    if device_mesh is None:
        device_mesh = current_mesh("distribute_module")
    # Check the hooks before touching the module, so a bad call changes nothing.
    pre_hook = _hook(input_fn, "input_fn", device_mesh, pre=True) if input_fn else None
    post_hook = _hook(output_fn, "output_fn", device_mesh, pre=False) if output_fn else None

    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_plain_states(submodule, device_mesh)

    if pre_hook is not None:
        module.register_forward_pre_hook(pre_hook)
    if post_hook is not None:
        module.register_forward_hook(post_hook)
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module


def _replicate_plain_states(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the module's own parameters and buffers that are not DTensors yet."""
    replicate = [Replicate()] * mesh.ndim
    for key, param in module._parameters.items():
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(
                key,
                nn.Parameter(
                    distribute_tensor(param.data, mesh, replicate),
                    requires_grad=param.requires_grad,
                ),
            )
    for key, buffer in module._buffers.items():
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[key] = distribute_tensor(buffer, mesh, replicate)


def _hook(fn: Callable[..., Any], what: str, mesh: DeviceMesh, *, pre: bool) -> Callable[..., Any]:
    """The forward (pre-)hook that calls ``fn`` with the mesh, by the number of its parameters."""
    try:
        n_args = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise TypeError(f"distribute_module: {what} is not a callable with a signature") from e
    if n_args == 2:
        warnings.warn(
            f"distribute_module: a {what} taking two arguments (values, device_mesh) is "
            f"deprecated; take (module, values, device_mesh) instead",
            FutureWarning,
            stacklevel=3,
        )
        if pre:
            return lambda mod, inputs: fn(inputs, mesh)
        return lambda mod, inputs, outputs: fn(outputs, mesh)
    if n_args != 3:
        raise ValueError(
            f"distribute_module: {what} should take 3 arguments (module, values, device_mesh), "
            f"found {n_args}"
        )
    if pre:
        return lambda mod, inputs: fn(mod, inputs, mesh)
    return lambda mod, inputs, outputs: fn(mod, outputs, mesh)

"""The DTensor states of a module tree: ties, ``_apply`` over DTensors, meta and device checks.

Helpers of :class:`~hyper_parallel.dmodule.module.Module` that need no Module: they walk
``_parameters``/``_buffers`` of any ``torch.nn.Module``.

Example::

    >>> import torch
    >>> states_on_meta(torch.nn.Linear(2, 2, device="meta"))
    ['weight', 'bias']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from hyper_parallel.dmodule._state_checks import REPLACED, UNSET
from hyper_parallel.dtensor import DTensor
from hyper_parallel.platform import get_platform

__all__ = [
    "apply_tree",
    "as_parameter",
    "device_type_of",
    "same_tensor",
    "states_on_meta",
    "tied_slots",
]


def tied_slots(root: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The ``(module, name)`` slots of each Parameter registered in more than one place."""
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for sub in root.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((sub, name))
    return [found for found in slots.values() if len(found) > 1]


def as_parameter(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` as a Parameter carrying ``old``'s ``requires_grad`` and Python attributes."""
    param = get_platform().Parameter(new, requires_grad=old.requires_grad)
    for key, value in old.__dict__.items():
        if key not in ("_is_param", "_hp_grad_hook", REPLACED, UNSET):
            param.__dict__[key] = value
    return param


_torch_apply = cast(
    "Callable[..., torch.nn.Module]",
    torch.nn.Module._apply,  # untyped in torch
)


def apply_tree(
    module: torch.nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    converted: dict[int, torch.Tensor],
    *,
    recurse: bool = True,
) -> None:
    """``nn.Module._apply`` over a subtree, DTensor states re-registered (memo: ``converted``)."""
    if recurse:
        for child in module.children():
            apply_tree(child, fn, converted)
    state_dicts: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    held: list[tuple[dict[str, Any], str, torch.Tensor]] = [
        (states, name, value)
        for states in state_dicts
        for name, value in states.items()
        if isinstance(value, DTensor)
    ]
    if not held:
        _torch_apply(module, fn, recurse=False)
        return
    with torch.no_grad():
        for states, _, value in held:
            if id(value) in converted:
                continue
            applied = fn(value)
            if states is module._parameters:
                param = as_parameter(applied, value)
                if value.grad is not None:
                    param.grad = fn(value.grad)
                applied = param
            converted[id(value)] = applied
    for states, name, _ in held:
        states[name] = None  # torch's _apply skips None states
    try:
        _torch_apply(module, fn, recurse=False)
    finally:
        for states, name, value in held:
            states[name] = converted[id(value)]


def same_tensor(result: torch.Tensor, param: torch.Tensor) -> bool:
    """True when ``result`` is ``param`` or a view of its memory (what an in-place init returns)."""
    if result is param:
        return True
    if isinstance(result, DTensor) or isinstance(param, DTensor):
        if not (isinstance(result, DTensor) and isinstance(param, DTensor)):
            return False
        result, param = result.to_local(), param.to_local()
    if result.device != param.device:
        return False
    if result.is_meta:
        return result.shape == param.shape  # meta tensors have no memory to compare
    return bool(result.untyped_storage().data_ptr() == param.untyped_storage().data_ptr())


def states_on_meta(module: torch.nn.Module, *, recurse: bool = True) -> list[str]:
    """Names of the (sub)tree's parameters and buffers that are meta tensors."""
    found = [n for n, p in module.named_parameters(recurse=recurse) if p.is_meta]
    return found + [n for n, b in module.named_buffers(recurse=recurse) if b.is_meta]


def device_type_of(module: torch.nn.Module) -> str:
    """The device type of ``module``'s first state not on meta (``"cpu"`` when none is)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device.type
    return "cpu"

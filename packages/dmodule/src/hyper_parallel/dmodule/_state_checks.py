"""Refusals for states a forward or an optimizer must not use: meta, never initialised, replaced.

Three misuses give silent wrong numbers in plain torch, and are refused here at the
first moment they matter, at no cost per step:

- a forward on states that are still on the meta device (``F.linear(cpu, meta)``
  without a bias returns zeros);
- a forward on states that ``to_empty()`` gave memory but nothing ever filled (a
  non-persistent buffer such as a RoPE table is filled by ``init_states`` only, not by
  ``load_hf`` or DCP's ``set_state_dict``), which gives NaN or garbage;
- an optimizer step over Parameter objects that ``parallelize`` or ``to_empty``/``to``
  replaced (the optimizer then updates tensors the model no longer uses).

The first two arm a forward pre-hook on the affected modules (the flag is the hook:
none exists on a model that needs no check); the first forward checks once and, when
all is well, removes the hooks of its subtree. A state counts as filled once it was
written in place (its version counter moved) or replaced by another tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = [
    "REPLACED",
    "arm_state_check",
    "check_optimizer_parameters",
    "mark_replaced",
    "meta_forward_message",
    "UNSET",
    "snapshot_states",
    "watch_fresh_states",
]

_HOOK = "_hp_state_check_hook"  # module.__dict__ key: id of the armed forward pre-hook
# tensor.__dict__ key: (id, _version) of the tensor right after it got empty memory. Kept on
# the tensor itself: a tensor that replaced it (even one at a freed one's address) has none,
# and a copy (deepcopy) has another id, so only the very object, unwritten, matches.
UNSET = "_hp_unset_since"
# Parameter.__dict__ key: where a replaced Parameter object used to be
REPLACED = "_hp_replaced_by"

StateSlot = tuple[torch.nn.Module, str, str, torch.Tensor]  # (owner, fqn, own name, tensor)


def _own_states(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for states in (module._parameters, module._buffers):
        for name, value in states.items():
            if value is not None:
                yield name, value


def _state(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    value = module._parameters.get(name)
    return module._buffers.get(name) if value is None else value


def snapshot_states(root: torch.nn.Module, *, recurse: bool = True) -> list[StateSlot]:
    """Every (owner, fqn, name, tensor) state slot of ``root``'s subtree.

    Example::

        >>> [fqn for _, fqn, _, _ in snapshot_states(torch.nn.Linear(2, 2))]
        ['weight', 'bias']
    """
    modules = root.named_modules() if recurse else iter([("", root)])
    return [
        (sub, f"{prefix}.{name}" if prefix else name, name, value)
        for prefix, sub in modules
        for name, value in _own_states(sub)
    ]


def _record_unset(module: torch.nn.Module, value: torch.Tensor) -> None:
    value.__dict__[UNSET] = (id(value), value._version)
    arm_state_check(module)


def watch_fresh_states(root: torch.nn.Module, before: list[StateSlot], *, everything: bool) -> None:
    """After ``root._apply``: note states that got memory without values, and replaced Parameters.

    ``before`` is :func:`snapshot_states` taken before the conversion. A state that was
    on meta and is not any more holds empty memory (nothing converts meta to values);
    with ``everything`` (``to_empty``) every state does. A Parameter whose object
    changed is marked replaced, so an optimizer still holding it is refused.

    Example::

        before = snapshot_states(model); model._apply(fn); watch_fresh_states(model, before, everything=False)
    """
    where = type(root).__name__
    armed_root = False
    for owner, fqn, name, old in before:
        new = _state(owner, name)
        if new is None:
            continue
        if new is not old and isinstance(old, torch.nn.Parameter) and name in owner._parameters:
            mark_replaced(old, f"{where}.{fqn} (replaced by to_empty()/to())")
        if not new.is_meta and new.numel() > 0 and (everything or old.is_meta):
            _record_unset(owner, new)
            armed_root = True
        elif new.is_meta:
            armed_root = True  # still on meta: the root's forward must see real inputs refused
    if armed_root:
        arm_state_check(root)


def arm_state_check(module: torch.nn.Module) -> None:
    """Check ``module``'s subtree once at its next forward (idempotent).

    Example::

        >>> layer = torch.nn.Linear(2, 2, device="meta")
        >>> arm_state_check(layer)
        >>> layer(torch.ones(2))
        Traceback (most recent call last):
        RuntimeError: Linear.forward: its states ['weight', 'bias'] are on the meta device ...
    """
    if _HOOK in module.__dict__:
        return
    handle = module.register_forward_pre_hook(_check_before_forward, with_kwargs=True)
    module.__dict__[_HOOK] = handle.id


def _disarm(module: torch.nn.Module) -> None:
    hook_id = module.__dict__.pop(_HOOK, None)
    if hook_id is not None:
        module._forward_pre_hooks.pop(hook_id, None)
        module._forward_pre_hooks_with_kwargs.pop(hook_id, None)


def _describe(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4])
    return f"[{shown}{', ...' if len(names) > 4 else ''}]" + (
        f" ({len(names)} in all)" if len(names) > 4 else ""
    )


def meta_forward_message(owner: str, names: list[str], device: torch.device) -> str:
    """The one refusal of a forward whose states are on meta while an input is real.

    Example::

        >>> meta_forward_message("Linear", ["weight"], torch.device("cpu"))[:44]
        "Linear.forward: its states ['weight'] are on"
    """
    return (
        f"{owner}.forward: its states {_describe(names)} are on the meta device (no memory), "
        f"but an input is on {device}; call model.to_empty(device=...) and "
        f"model.init_states() before running it"
    )


def _check_before_forward(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward pre-hook: refuse meta or never-initialised states; disarm the subtree when fine."""
    on_meta: list[str] = []
    unset: list[str] = []
    for owner, fqn, name, value in snapshot_states(module):
        if value.is_meta:
            on_meta.append(fqn)
            continue
        since = value.__dict__.get(UNSET)
        if since is None:
            continue
        if since == (id(value), value._version):
            persistent = name in owner._parameters or name not in owner._non_persistent_buffers_set
            unset.append(fqn if persistent else f"{fqn} (non-persistent buffer)")
        else:
            del value.__dict__[UNSET]  # written since: never looked at again
    owner_name = type(module).__name__
    if on_meta:
        real = [
            x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and not x.is_meta
        ]
        if real:
            raise RuntimeError(meta_forward_message(owner_name, on_meta, real[0].device))
        return  # a forward on meta inputs (tracing shapes) is fine; stay armed
    if unset:
        raise RuntimeError(
            f"{owner_name}.forward: {len(unset)} state(s) were never initialised since "
            f"to_empty() gave them memory without values: {_describe(unset)}; call "
            f"model.init_states() (init_weights() on a BaseModel) after to_empty(), then load "
            f"a checkpoint if any: load_hf and DCP set_state_dict fill only persistent states, "
            f"so non-persistent buffers (e.g. RoPE tables) come from init_states alone"
        )
    for sub in module.modules():
        _disarm(sub)


# -- optimizers holding replaced Parameters ---------------------------------------------
class _Replacements:
    """How many Parameters were replaced so far; an optimizer is re-checked when it grows."""

    count = 0
    hook_installed = False


def mark_replaced(old: torch.Tensor, where: str) -> None:
    """Mark a Parameter object that the model no longer holds; optimizers holding it are refused.

    Example::

        mark_replaced(old_weight, "Dense.weight (replaced by parallelize())")
    """
    old.__dict__[REPLACED] = where
    _Replacements.count += 1
    if not _Replacements.hook_installed:
        # One global step pre-hook, installed by the first replacement (never at import):
        # the only place that sees an optimizer built too early.
        register_optimizer_step_pre_hook(check_optimizer_parameters)
        _Replacements.hook_installed = True


def check_optimizer_parameters(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Optimizer step pre-hook: raise if the optimizer holds a replaced Parameter.

    Checked again only when a replacement happened or the param groups changed size, so
    a step costs a tuple compare.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> check_optimizer_parameters(opt, (), {})
    """
    key = (_Replacements.count, tuple(len(group["params"]) for group in optimizer.param_groups))
    if optimizer.__dict__.get("_hp_checked") == key:
        return
    stale = [
        str(p.__dict__[REPLACED])
        for group in optimizer.param_groups
        for p in group["params"]
        if REPLACED in p.__dict__
    ]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: {len(stale)} of its parameters are no longer the "
            f"model's: {_describe(stale)}; parallelize() lays each parameter out as a new "
            f"DTensor Parameter (and to_empty()/to() may make new ones), so this optimizer would "
            f"update tensors the model does not use; build the optimizer after parallelize() "
            f"and to_empty(), from model.parameters()"
        )
    optimizer.__dict__["_hp_checked"] = key

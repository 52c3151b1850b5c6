"""The parallel subclass of a module class: its ``forward`` runs the instance's ForwardPlan."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from hyper_parallel.dmodule._forward import ForwardPlan
from hyper_parallel.dmodule._state_checks import meta_forward_message
from hyper_parallel.dmodule._state_tree import states_on_meta

if TYPE_CHECKING:

    class _PlannedModule(torch.nn.Module):
        """What the parallel forward reads of a ``Module`` (``module`` imports this file)."""

        _hp_forward_plan: ForwardPlan | None
        _hp_states_on_meta: bool


# Per original class, its subclass whose forward runs the ForwardPlan (see _parallel_class).
_parallel_classes: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``forward`` runs the instance's :class:`ForwardPlan`.

    Installing the wrapper at class level (rather than a closure stored on the
    instance) leaves no reference cycle, survives ``copy.deepcopy`` and also covers
    direct ``module.forward(...)`` calls.
    """
    if getattr(cls, "_hp_parallel_base", None) is not None:
        return cls
    cached = _parallel_classes.get(cls)
    if cached is not None:
        return cached
    base_forward = cast("Callable[..., Any]", getattr(cls, "forward"))  # noqa: B009

    def forward(self: _PlannedModule, *args: Any, **kwargs: Any) -> Any:
        plan = self._hp_forward_plan
        assert plan is not None
        if self._hp_states_on_meta:
            _refuse_meta_forward(self, args, kwargs)
        if plan.local_map:
            return plan.call_local(self, base_forward, args, kwargs)
        args, kwargs = plan.prepare_inputs(args, kwargs)
        return plan.finish_outputs(base_forward(self, *args, **kwargs))

    forward.__doc__ = base_forward.__doc__
    forward.__wrapped__ = base_forward  # type: ignore[attr-defined]
    new_cls = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "_hp_parallel_base": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    _parallel_classes[cls] = new_cls
    return new_cls


def _refuse_meta_forward(
    module: _PlannedModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raise unless the inputs are meta too (a meta forward, e.g. to trace shapes, is fine)."""
    inputs = [*args, *kwargs.values()]
    real = [x for x in inputs if isinstance(x, torch.Tensor) and not x.is_meta]
    if real:
        names = states_on_meta(module, recurse=False)
        raise RuntimeError(meta_forward_message(type(module).__name__, names, real[0].device))

"""The whole-call handlers of the ``_foreach_*`` ops (above the DTensor class).

Before an in-place foreach op meets its rule (``foreach.py``), a Partial self is reduced
unless the op only scales it; a foreach op whose tensors live on several meshes runs
once per mesh.
"""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dtensor._ops.foreach import _IN_PLACE, _OUT_OF_PLACE
from hyper_parallel.dtensor._redistribute import redistribute_local
from hyper_parallel.dtensor._registry import register_special
from hyper_parallel.dtensor._spec import DTensorSpec, partial_to_replicate
from hyper_parallel.dtensor._tensor import dispatch_by_rules

aten = torch.ops.aten

# in-place ops that scale their first argument: a Partial(sum) self may stay Partial
_SCALES = {"mul", "div"}


def _keep_partial_self(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
    """True when the op scales self by something that is not itself Partial (linear in self)."""
    name = func._schema.name.split("::")[1].removeprefix("_foreach_").rstrip("_")
    if name not in _SCALES:
        return False
    other = args[1] if len(args) > 1 else None
    values = other if isinstance(other, (list, tuple)) else [other]
    return not any(
        isinstance(v, torch.Tensor) and hasattr(v, "_spec") and v._spec.has_partial()
        for v in values
    )


def _foreach_in_place(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """In-place foreach ops: reduce a Partial self first unless the op only scales it, then plan."""
    selves = args[0]
    if not _keep_partial_self(func, args):
        for t in selves:
            spec = getattr(t, "_spec", None)
            if isinstance(spec, DTensorSpec) and spec.has_partial():
                target = partial_to_replicate(spec.placements)
                t._local_tensor = redistribute_local(t._local_tensor, spec, target)
                t._spec = spec.with_placements(target)
    dispatch_by_rules(func, args, kwargs)


def _per_mesh(handler: Any) -> Any:
    """Run a foreach op once per mesh when its tensors live on several (one group per mesh).

    An optimizer's parameter list may mix meshes (e.g. tp-sharded weights and
    dp-replicated norms); torch runs each mesh's slice of the lists separately too.
    """

    def run(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first = args[0]
        meshes = [t._spec.mesh for t in first if isinstance(getattr(t, "_spec", None), DTensorSpec)]
        if len(meshes) != len(first) or all(m == meshes[0] for m in meshes):
            return handler(func, args, kwargs)
        n = len(first)
        groups: dict[Any, list[int]] = {}
        for i, mesh in enumerate(meshes):
            groups.setdefault(mesh, []).append(i)
        results: list[Any] = [None] * n
        returned = False
        for indices in groups.values():

            def pick(value: Any, indices: list[int] = indices) -> Any:
                if isinstance(value, (list, tuple)) and len(value) == n:
                    return [value[i] for i in indices]
                return value

            out = handler(
                func, tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}
            )
            if out is not None:
                returned = True
                for i, o in zip(indices, out, strict=True):
                    results[i] = o
        return results if returned else None

    return run


register_special(*_IN_PLACE)(_per_mesh(_foreach_in_place))
register_special(*_OUT_OF_PLACE, aten._foreach_norm.Scalar)(_per_mesh(dispatch_by_rules))

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
from hyper_parallel.dtensor._tensor import DTensor, dispatch_by_rules

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
    for v in values:  # an optimizer step asks this of every state: no call per DTensor
        spec = v._spec if type(v) is DTensor else _spec_of(v)
        if spec is not None and spec._partial:
            return False
    return True


def _spec_of(value: Any) -> DTensorSpec | None:
    """The DTensorSpec of a DTensor (of any class), else ``None``."""
    spec = getattr(value, "_spec", None) if isinstance(value, torch.Tensor) else None
    return spec if isinstance(spec, DTensorSpec) else None


def _foreach_in_place(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """In-place foreach ops: reduce a Partial self first unless the op only scales it, then plan."""
    selves = args[0]
    if not _keep_partial_self(func, args):
        for t in selves:
            spec = t._spec if type(t) is DTensor else _spec_of(t)
            if spec is not None and spec._partial:
                target = partial_to_replicate(spec.placements)
                t._local_tensor = redistribute_local(t._local_tensor, spec, target)
                t._spec = spec.with_placements(target)
    dispatch_by_rules(func, args, kwargs)


_SCALAR_TYPES = (float, int, bool)


def _local_lists(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The local call of an in-place foreach op that every rank may run on its shards
    alone, or ``None``.

    That is when every list argument holds DTensors (of this class) laid out index by
    index like ``self``'s (one mesh, equal placements, none Partial, the same global
    shape): each index is then an element-wise op on equal shards, which the rule plans
    with no move and no relabel. Everything else is a plain scalar (no tensor scalar).
    An optimizer step runs each of its foreach ops this way: no plan lookup, no call
    per tensor.
    """
    selves = args[0]
    if type(selves) is not list or not selves:
        return None
    specs: list[DTensorSpec] = []
    local_selves: list[torch.Tensor] = []
    for t in selves:
        if type(t) is not DTensor:
            return None
        spec = t._spec
        if spec._partial:
            return None
        specs += (spec,)
        local_selves += (t._local_tensor,)
    local_args: list[Any] = [local_selves]
    n = len(specs)
    for a in args[1:]:
        if type(a) is list:
            if len(a) != n:
                return None
            if type(a[0]) is DTensor:
                local: list[torch.Tensor] = []
                for i, e in enumerate(a):
                    if type(e) is not DTensor:
                        return None
                    spec, own = e._spec, specs[i]
                    if spec is not own and (
                        spec.mesh is not own.mesh
                        or spec.placements != own.placements
                        or spec.tensor_meta.shape != own.tensor_meta.shape
                    ):
                        return None
                    local += (e._local_tensor,)
                local_args += (local,)
                continue
            for e in a:
                if type(e) not in _SCALAR_TYPES:
                    return None
        elif type(a) not in _SCALAR_TYPES:
            return None
        local_args += (a,)
    if kwargs:
        for v in kwargs.values():
            if type(v) not in _SCALAR_TYPES:
                return None
    return local_args


def _in_place_special(handler: Any) -> Any:
    """An in-place foreach op: on the local lists when ``_local_lists`` allows, else ``handler``."""

    def run(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        local_args = _local_lists(args, kwargs)
        if local_args is None:
            return handler(func, args, kwargs)
        func._op(*local_args, **kwargs)
        return None

    return run


def _per_mesh(handler: Any) -> Any:
    """Run a foreach op once per mesh when its tensors live on several (one group per mesh).

    An optimizer's parameter list may mix meshes (e.g. tp-sharded weights and
    dp-replicated norms); torch runs each mesh's slice of the lists separately too.
    """

    def run(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first = args[0]
        meshes: list[Any] = []
        for t in first:  # no call per DTensor: an optimizer's lists hold every state
            spec = t._spec if type(t) is DTensor else _spec_of(t)
            if spec is None:
                return handler(func, args, kwargs)  # not all DTensors: the rule decides
            meshes += (spec.mesh,)
        one = meshes[0] if meshes else None
        for mesh in meshes:
            if mesh is not one and mesh != one:
                break
        else:
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


register_special(*_IN_PLACE)(_in_place_special(_per_mesh(_foreach_in_place)))
register_special(*_OUT_OF_PLACE, aten._foreach_norm.Scalar)(_per_mesh(dispatch_by_rules))

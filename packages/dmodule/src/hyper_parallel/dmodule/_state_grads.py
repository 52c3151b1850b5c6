"""Declared layouts of states' local gradients (``LocalMapConfig.state_grad_placements``).

A replicated state used on sharded activations (a norm weight on sequence shards) has a
local gradient that sums this rank's tokens only; its module declares the placements of
that gradient (``{"weight": {tp: Partial()}}``) and the states' autograd node of the
region that takes the states local wraps the gradient so, to be reduced once where it
accumulates on the parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from hyper_parallel.dmodule.sharding import resolve_placements
from hyper_parallel.dtensor import Placement

__all__ = ["declared_grad_layouts"]

Placements: TypeAlias = tuple[Placement, ...]

# module -> {(id of a state dict of its subtree, state name): [declared placements by axis
# name, the mesh they were last resolved on, the resolved placements]}
_grad_decls: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, str], list[Any]]] = (
    weakref.WeakKeyDictionary()
)


def declared_grad_layouts(
    module: torch.nn.Module, slots: Sequence[tuple[dict[str, Any], str, Any]]
) -> list[Placements | None] | None:
    """Each state's declared gradient placements (``local_map.state_grad_placements`` of the
    module owning it, anywhere in ``module``'s subtree), ``None`` where undeclared; ``None``
    when nothing in the subtree declares any.

    Example::

        >>> declared_grad_layouts(torch.nn.Linear(2, 2), [])   # nothing declared
    """
    decls = _grad_decls.get(module)
    if decls is None:
        decls = _grad_decls[module] = _collect_grad_decls(module)
    if not decls:
        return None
    out: list[Placements | None] = []
    for states, name, state in slots:
        found = decls.get((id(states), name))
        if found is None:
            out.append(None)
            continue
        if found[1] is not state.device_mesh:
            names = state.device_mesh.mesh_dim_names or ()
            where = f"local_map.state_grad_placements[{name!r}]"
            found[1] = state.device_mesh
            found[2] = tuple(resolve_placements(found[0], names, where=where))
        out.append(found[2])
    return out


def _collect_grad_decls(module: torch.nn.Module) -> dict[tuple[int, str], list[Any]]:
    decls: dict[tuple[int, str], list[Any]] = {}
    for sub in module.modules():
        config = getattr(sub, "sharding_config", None)
        local_map = getattr(config, "local_map", None)
        declared = getattr(local_map, "state_grad_placements", None)
        if not declared:
            continue
        for path, named in declared.items():
            owner_path, _, leaf = path.rpartition(".")
            owner = sub.get_submodule(owner_path) if owner_path else sub
            for states in (owner._parameters, owner._buffers):
                decls[(id(states), leaf)] = [named, None, ()]
    return decls

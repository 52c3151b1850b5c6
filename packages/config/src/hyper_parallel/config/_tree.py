"""Walking config trees: the deep-for-configs copy used by build(), and traverse()."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Iterator
from typing import Any, TypeVar

from hyper_parallel.config.errors import ConfigError, join_path

__all__ = ["copy_tree", "walk_configs"]

_T = TypeVar("_T")


def copy_tree(value: _T) -> _T:
    """Copy ``value``: containers and dataclasses deeply, callables and other leaves not at all.

    A non-frozen dataclass, list, dict or set is always copied; a tuple or frozen dataclass
    only when something inside it had to be copied (otherwise it is immutable and shared).
    Configs are values: a node that appears twice in ``value`` is copied twice, so the copy
    shares nothing (the same as ``to_dict``/``from_dict`` would give). A node that contains
    itself is a ``ConfigError`` naming the path.
    """
    copied: _T = _copy(value, {}, [])
    return copied


def _copy(value: Any, active: dict[int, int], trail: list[object]) -> Any:
    """``trail``: the keys from the root to ``value`` (paths are only spelt out for an error)."""
    cls = type(value)
    if cls in (list, dict, tuple, set) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        pass
    elif isinstance(value, (list, dict, set)):  # subclasses of containers: keep their type
        return copy.deepcopy(value, {})
    else:
        return value  # callables, placements, enums, scalars, tensors: kept as they are
    key = id(value)
    if key in active:
        raise ConfigError(
            f"cannot copy a cyclic config: this value is its own ancestor at "
            f"{_spell(trail[: active[key]]) or '<root>'!r}",
            path=_spell(trail),
        )
    active[key] = len(trail)
    try:
        if cls is list:
            return [_copy_item(v, i, active, trail) for i, v in enumerate(value)]
        if cls is dict:
            return {k: _copy_item(v, k, active, trail) for k, v in value.items()}
        if cls is tuple:
            items = tuple(_copy_item(v, i, active, trail) for i, v in enumerate(value))
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        if cls is set:
            return {_copy(v, active, trail) for v in value}
        return _copy_dataclass(value, active, trail)
    finally:
        del active[key]


def _copy_item(value: Any, key: object, active: dict[int, int], trail: list[object]) -> Any:
    trail.append(key)
    try:
        return _copy(value, active, trail)
    finally:
        trail.pop()


def _spell(trail: list[object]) -> str:
    path = ""
    for key in trail:
        path = join_path(path, key)
    return path


def _copy_dataclass(value: Any, active: dict[int, int], trail: list[object]) -> Any:
    frozen = type(value).__dataclass_params__.frozen
    fields = dataclasses.fields(value)
    copied = {f.name: _copy_item(getattr(value, f.name), f.name, active, trail) for f in fields}
    if frozen and all(copied[f.name] is getattr(value, f.name) for f in fields):
        return value  # immutable and holds nothing mutable: share it, like a placement
    new = copy.copy(value)
    for name, item in copied.items():
        object.__setattr__(new, name, item)  # frozen dataclasses refuse plain setattr
    return new


def walk_configs(root: object, config_base: type) -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield ``(fqn, node, parent, key)`` for every ``config_base`` instance, pre-order.

    After a node is yielded the walk re-reads its position, so a caller that replaced the
    node in place (``setattr(parent, key, new)`` / ``parent[key] = new``) walks the new node's
    children instead of the old ones; the replacement itself is not yielded again.
    """
    yield "", root, None, None
    yield from _children(root, "", config_base, {})


def _children(
    node: object, fqn: str, config_base: type, active: dict[int, str]
) -> Iterator[tuple[str, Any, Any, Any]]:
    if isinstance(node, config_base):
        entries: list[tuple[Hashable, Any]] = [
            (f.name, getattr(node, f.name))
            for f in dataclasses.fields(node)  # type: ignore[arg-type]
        ]
    elif isinstance(node, (list, tuple)):
        entries = list(enumerate(node))
    elif isinstance(node, dict):
        entries = list(node.items())
    else:
        return
    seen = active.get(id(node))
    if seen is not None:
        raise ConfigError(
            f"cannot traverse a cyclic config: this value is its own ancestor at "
            f"{seen or '<root>'!r}",
            path=fqn,
        )
    active[id(node)] = fqn
    try:
        for key, child in entries:
            child_fqn = join_path(fqn, key)
            if isinstance(child, config_base):
                yield child_fqn, child, node, key
                child = _reread(node, key, child)
            yield from _children(child, child_fqn, config_base, active)
    finally:
        del active[id(node)]


def _reread(parent: Any, key: Any, fallback: object) -> object:
    if isinstance(parent, (list, tuple, dict)):
        try:
            return parent[key]
        except (IndexError, KeyError):
            return fallback
    return getattr(parent, str(key), fallback)

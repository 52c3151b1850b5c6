"""Walking config trees: the deep-for-configs copy used by build(), and traverse()."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Hashable, Iterator
from typing import Any, TypeVar

from hyper_parallel.config.errors import join_path

__all__ = ["copy_tree", "walk_configs"]

_T = TypeVar("_T")


def copy_tree(value: _T) -> _T:
    """Copy ``value``: containers and dataclasses deeply, callables and other leaves not at all.

    A non-frozen dataclass, list, dict or set is always copied; a tuple or frozen dataclass
    only when something inside it had to be copied (otherwise it is immutable and shared).
    Shared nodes stay shared within the copy (like ``copy.deepcopy``).
    """
    copied: _T = _copy(value, {})
    return copied


def _copy(value: Any, memo: dict[int, Any]) -> Any:
    done = memo.get(id(value))
    if done is not None:
        return done
    cls = type(value)
    if cls is list:
        new_list: list[Any] = []
        memo[id(value)] = new_list
        new_list.extend(_copy(v, memo) for v in value)
        return new_list
    if cls is dict:
        new_dict: dict[Any, Any] = {}
        memo[id(value)] = new_dict
        for k, v in value.items():
            new_dict[k] = _copy(v, memo)
        return new_dict
    if cls is tuple:
        items = tuple(_copy(v, memo) for v in value)
        result = value if all(a is b for a, b in zip(items, value, strict=True)) else items
    elif cls is set:
        result = {_copy(v, memo) for v in value}
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        result = _copy_dataclass(value, memo)
    elif isinstance(value, (list, dict, set)):  # subclasses of containers: keep their type
        result = copy.deepcopy(value, {})
    else:  # callables, placements, enums, scalars, tensors: kept as they are
        return value
    memo[id(value)] = result
    return result


def _copy_dataclass(value: Any, memo: dict[int, Any]) -> Any:
    frozen = type(value).__dataclass_params__.frozen
    fields = dataclasses.fields(value)
    if not frozen:
        new = copy.copy(value)
        memo[id(value)] = new  # before recursing, so shared/cyclic references resolve to it
        for f in fields:
            object.__setattr__(new, f.name, _copy(getattr(value, f.name), memo))
        return new
    copied = {f.name: _copy(getattr(value, f.name), memo) for f in fields}
    if all(copied[f.name] is getattr(value, f.name) for f in fields):
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
    yield from _children(root, "", config_base)


def _children(node: object, fqn: str, config_base: type) -> Iterator[tuple[str, Any, Any, Any]]:
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
    for key, child in entries:
        child_fqn = join_path(fqn, key)
        if isinstance(child, config_base):
            yield child_fqn, child, node, key
            child = _reread(node, key, child)
        yield from _children(child, child_fqn, config_base)


def _reread(parent: Any, key: Any, fallback: object) -> object:
    if isinstance(parent, (list, tuple, dict)):
        try:
            return parent[key]
        except (IndexError, KeyError):
            return fallback
    return getattr(parent, str(key), fallback)

"""Reading dataclass annotations: resolved field types, unions, readable type names."""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from hyper_parallel.config.errors import ConfigError

__all__ = [
    "MAPPING_ORIGINS",
    "SEQUENCE_ORIGINS",
    "format_type",
    "init_fields",
    "is_any",
    "resolved_field_types",
    "strip_annotated",
    "union_members",
]

#: Annotations read as lists / as dicts.
SEQUENCE_ORIGINS = (list, collections.abc.Sequence, collections.abc.MutableSequence)
MAPPING_ORIGINS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)

# Resolving annotations (get_type_hints) is the slow part of from_dict; classes never change
# their annotations once created, so a weak per-class cache is safe and frees dead classes.
_HINTS: weakref.WeakKeyDictionary[type, dict[str, object]] = weakref.WeakKeyDictionary()
_FIELDS: weakref.WeakKeyDictionary[type, dict[str, dataclasses.Field[Any]]] = (
    weakref.WeakKeyDictionary()
)


def init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` that its ``__init__`` takes, by name."""
    found = _FIELDS.get(cls)
    if found is None:
        found = {f.name: f for f in dataclasses.fields(cls) if f.init}
        _FIELDS[cls] = found
    return found


def resolved_field_types(cls: type) -> dict[str, object]:
    """Field name -> resolved annotation of dataclass ``cls`` (string annotations evaluated)."""
    found = _HINTS.get(cls)
    if found is None:
        try:
            hints = typing.get_type_hints(cls, include_extras=True)
        except Exception as err:  # NameError, TypeError, SyntaxError from user annotations
            raise ConfigError(
                f"cannot resolve the annotations of {format_type(cls)}: {err} "
                f"(names used in annotations must be importable from {cls.__module__!r})"
            ) from err
        found = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}
        _HINTS[cls] = found
    return found


def strip_annotated(ann: object) -> object:
    """``Annotated[X, ...]`` -> ``X``; anything else unchanged."""
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    return ann


def union_members(ann: object) -> tuple[object, ...] | None:
    """Members of ``X | Y`` / ``Union[X, Y]`` / ``Optional[X]``; ``None`` for other types."""
    origin = typing.get_origin(ann)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(ann)
    return None


def is_any(ann: object) -> bool:
    """True for annotations that constrain nothing (``Any``, ``object``, a bare TypeVar)."""
    return ann is Any or ann is object or isinstance(ann, typing.TypeVar)


_NAMES: dict[object, str] = {
    Sequence: "Sequence",
    Mapping: "Mapping",
    Callable: "Callable",
    type(None): "None",
}


def format_type(ann: object) -> str:
    """Readable name of an annotation: ``int``, ``list[Linear.Config]``, ``int | None``."""
    ann = strip_annotated(ann)
    if isinstance(ann, list):  # the parameter list of Callable[[X, Y], Z]
        return "[" + ", ".join(format_type(a) for a in ann) + "]"
    members = union_members(ann)
    if members is not None:
        return " | ".join(format_type(m) for m in members)
    if ann in _NAMES:
        return _NAMES[ann]
    origin = typing.get_origin(ann)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(ann))
    if origin is not None:
        args = typing.get_args(ann)
        head = _NAMES.get(origin) or str(getattr(origin, "__qualname__", origin))
        if not args:
            return head
        inner = ", ".join("..." if a is Ellipsis else format_type(a) for a in args)
        return f"{head}[{inner}]"
    if ann is Any:
        return "Any"
    if isinstance(ann, type):  # classes defined in functions: drop the "f.<locals>." prefix
        return ann.__qualname__.rsplit("<locals>.", 1)[-1]
    return str(ann).replace("typing.", "")

"""The JSON form of a config both directions share: its tags, class references, item annotations."""

from __future__ import annotations

import importlib
import typing
from typing import Any, TypeAlias

from hyper_parallel.config._annotations import (
    MAPPING_ORIGINS,
    SEQUENCE_ORIGINS,
    strip_annotated,
    union_members,
)

__all__ = [
    "CALLABLE_TAG",
    "PARTIAL_TAG",
    "TYPE_TAG",
    "JSONValue",
    "class_ref",
    "item_type",
    "mapping_types",
]

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
"""Data that ``json.dumps`` accepts, as ``to_dict`` produces it."""

TYPE_TAG = "_type_"
"""Key recording the concrete class of a dataclass that is not exactly its declared type."""
CALLABLE_TAG = "_callable_"
"""``{"_callable_": "module:qualname"}``: an importable function or class."""
PARTIAL_TAG = "_partial_"
"""``{"_partial_": "module:qualname", "args": [...], "kwargs": {...}}``: a functools.partial."""


def class_ref(obj: Any) -> str:
    """``"module:qualname"`` of a class or function."""
    return f"{obj.__module__}:{obj.__qualname__}"


def _import_attribute(module: str, qualname: str) -> object:
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _narrow(declared: object, origins: tuple[object, ...]) -> object:
    """The member of a union whose container kind is one of ``origins`` (Any if none)."""
    declared = strip_annotated(declared)
    for member in union_members(declared) or (declared,):
        member = strip_annotated(member)
        if typing.get_origin(member) in origins or member in origins:
            return member
    return Any


def item_type(declared: object, index: int) -> object:
    """Annotation of item ``index`` of a list/tuple declared as ``declared``."""
    seq = _narrow(declared, (*SEQUENCE_ORIGINS, tuple))
    args = typing.get_args(seq)
    if not args:
        return Any
    if typing.get_origin(seq) is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        if args == ((),):
            return Any
        return args[index] if index < len(args) else Any
    return args[0]


def mapping_types(declared: object) -> tuple[object, object]:
    """(key annotation, value annotation) of a dict declared as ``declared``."""
    mapping = _narrow(declared, MAPPING_ORIGINS)
    args = typing.get_args(mapping)
    return (args[0], args[1]) if len(args) == 2 else (Any, Any)

"""Config trees <-> JSON data: to_dict encoding here, from_dict decoding re-exported.

The decoder (``Decoder``) lives in ``_decode``, the tags and container annotations both
directions use in ``_json_form``; every name this module exported stays importable from it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Callable
from typing import Any

from hyper_parallel.config._annotations import (
    MAPPING_ORIGINS,
    SEQUENCE_ORIGINS,
    init_fields,
    resolved_field_types,
    strip_annotated,
    union_members,
)
from hyper_parallel.config._decode import Decoder, ImportRefused, decode_leaf, module_allowed
from hyper_parallel.config._json_form import (
    CALLABLE_TAG,
    PARTIAL_TAG,
    TYPE_TAG,
    JSONValue,
    _import_attribute,
    class_ref,
    item_type,
    mapping_types,
)
from hyper_parallel.config.errors import ConfigError, describe, join_path
from hyper_parallel.config.leaf_codec import LeafCodec, leaf_codec

__all__ = [
    "CALLABLE_TAG",
    "decode_leaf",
    "MAPPING_ORIGINS",
    "SEQUENCE_ORIGINS",
    "PARTIAL_TAG",
    "TYPE_TAG",
    "JSONValue",
    "Decoder",
    "ImportRefused",
    "class_ref",
    "encode",
    "item_type",
    "mapping_types",
    "module_allowed",
]


def encode(value: object, declared: object, path: str) -> JSONValue:
    """JSON data for ``value`` declared as ``declared`` at ``path`` (see Config.to_dict).

    A value that holds itself (a cycle) is a ``ConfigError`` naming both paths.
    """
    return _Encoder().encode(value, declared, path)


class _Encoder:
    """One ``to_dict`` walk: remembers the containers on the current path to find cycles."""

    def __init__(self) -> None:
        self._active: dict[int, str] = {}

    def encode(self, value: object, declared: object, path: str) -> JSONValue:
        codec = _codec_for(declared, value)
        if codec is not None:
            try:
                return codec.encode(value)  # type: ignore[no-any-return]
            except (TypeError, ValueError) as err:
                raise ConfigError(
                    f"cannot convert to JSON data ({codec.expected}): {err}", path=path
                ) from err
        if isinstance(value, enum.Enum):
            inner = value.value
            ok = isinstance(inner, (str, int, float)) and not isinstance(inner, bool)
            return inner if ok else value.name  # type: ignore[no-any-return]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        is_node = isinstance(value, (list, tuple, dict)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        )
        if not is_node:
            return self._encode_leaf(value, path)
        seen = self._active.get(id(value))
        if seen is not None:
            raise ConfigError(
                f"cannot convert a cyclic config to JSON data: this value is its own "
                f"ancestor at {seen or '<root>'!r}",
                path=path,
            )
        self._active[id(value)] = path
        try:
            return self._encode_node(value, declared, path)
        finally:
            del self._active[id(value)]

    def _encode_node(self, value: object, declared: object, path: str) -> JSONValue:
        if isinstance(value, (list, tuple, dict)):
            origins = MAPPING_ORIGINS if isinstance(value, dict) else (*SEQUENCE_ORIGINS, tuple)
            candidates = _members_of_kind(declared, origins)
            # A union of several container types (e.g. OutputShardings): the first member
            # the value encodes under is the one it was meant as.
            for candidate in candidates[:-1]:
                try:
                    return self._encode_container(value, candidate, path)
                except ConfigError:
                    continue
            return self._encode_container(value, candidates[-1], path)
        cls = type(value)
        data: dict[str, JSONValue] = {}
        if _declared_classes(declared) != {cls}:
            data[TYPE_TAG] = class_ref(cls)
        hints = resolved_field_types(cls)
        for name in init_fields(cls):
            data[name] = self.encode(getattr(value, name), hints[name], join_path(path, name))
        return data

    def _encode_container(self, value: object, declared: object, path: str) -> JSONValue:
        if isinstance(value, dict):
            _, value_type = mapping_types(declared)
            out: dict[str, JSONValue] = {}
            for key, item in value.items():
                out[_encode_key(key, path)] = self.encode(item, value_type, join_path(path, key))
            return out
        assert isinstance(value, (list, tuple))
        return [
            self.encode(item, item_type(declared, i), join_path(path, i))
            for i, item in enumerate(value)
        ]

    def _encode_leaf(self, value: object, path: str) -> JSONValue:
        if isinstance(value, functools.partial):
            args = [
                self.encode(a, Any, join_path(path, f"args.{i}")) for i, a in enumerate(value.args)
            ]
            kwargs = {k: self.encode(v, Any, join_path(path, k)) for k, v in value.keywords.items()}
            return {PARTIAL_TAG: _callable_ref(value.func, path), "args": args, "kwargs": kwargs}
        if callable(value):
            return {CALLABLE_TAG: _callable_ref(value, path)}
        raise ConfigError(
            f"cannot convert to JSON data: expected a JSON scalar, list, tuple, dict, Enum, "
            f"dataclass, importable callable or a type with a LeafCodec in its annotation, "
            f"found {describe(value)}",
            path=path,
        )


def _codec_for(declared: object, value: object) -> LeafCodec | None:
    """The codec in ``declared`` (or one of its union members) that ``value`` is an instance of."""
    codecs: tuple[LeafCodec, ...] = _codecs_of(declared)
    for codec in codecs:
        if isinstance(value, codec.type):
            return codec
    return None


def _cached(function: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise on hashable annotations (most are); compute unhashable ones every time."""
    memo: dict[Any, Any] = {}

    def lookup(*args: Any) -> Any:
        try:
            return memo[args]
        except KeyError:
            found = memo[args] = function(*args)
            return found
        except TypeError:
            return function(*args)

    return lookup


@_cached
def _codecs_of(declared: object) -> tuple[LeafCodec, ...]:
    codec = leaf_codec(declared)
    if codec is not None:
        return (codec,)
    members = union_members(strip_annotated(declared)) or ()
    return tuple(c for c in map(leaf_codec, members) if c is not None)


@_cached
def _members_of_kind(declared: object, origins: tuple[object, ...]) -> list[object]:
    """The members of ``declared`` (a union or one type) whose container kind is in ``origins``."""
    declared = strip_annotated(declared)
    found = [
        member
        for member in union_members(declared) or (declared,)
        if typing.get_origin(strip_annotated(member)) in origins
        or strip_annotated(member) in origins
    ]
    return found or [Any]


def _encode_key(key: object, path: str) -> str:
    if isinstance(key, enum.Enum):
        key = key.value if isinstance(key.value, str) else key.name
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise ConfigError(f"dict key: expected str, int or Enum, found {describe(key)}", path=path)


def _callable_ref(obj: object, path: str) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        try:
            found = _import_attribute(module, qualname)
        except (ImportError, AttributeError):
            found = None
        if found is obj:
            return f"{module}:{qualname}"
    raise ConfigError(
        f"cannot convert callable to JSON data: expected an importable function or class "
        f"(module-level, reachable as module:qualname), found {describe(obj)}",
        path=path,
    )


def _declared_classes(declared: object) -> set[type]:
    declared = strip_annotated(declared)
    members = union_members(declared) or (declared,)
    return {m for m in members if isinstance(m, type) and m is not type(None)}

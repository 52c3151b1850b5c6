"""Dotted ``path=value`` overrides: finding the annotation at a path and parsing text by it."""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import json
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from hyper_parallel.config._annotations import (
    format_type,
    init_fields,
    is_any,
    resolved_field_types,
    strip_annotated,
    union_members,
)
from hyper_parallel.config._check import checked_elsewhere
from hyper_parallel.config._codec import (
    MAPPING_ORIGINS,
    SEQUENCE_ORIGINS,
    Decoder,
    ImportRefused,
    decode_leaf,
    item_type,
    mapping_types,
)
from hyper_parallel.config._tree import copy_tree
from hyper_parallel.config.errors import (
    ConfigError,
    describe,
    did_you_mean,
    join_path,
    relocate,
    union_error,
)
from hyper_parallel.config.leaf_codec import leaf_codec

__all__ = ["apply_overrides", "parse_text"]

_T = TypeVar("_T")
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_NONE = frozenset({"none", "null"})
_INT = re.compile(r"[+-]?\d+")


def apply_overrides(root: _T, overrides: Iterable[str], decoder: Decoder) -> _T:
    """A copy of ``root`` with each ``"dotted.path=value"`` applied in order; ``root`` is untouched."""
    if isinstance(overrides, str):
        raise ConfigError(
            f"expected a list of 'path=value' strings, found a single str {overrides!r}"
        )
    result = copy_tree(root)
    for text in overrides:
        path, sep, raw = text.partition("=")
        path = path.strip()
        steps = path.split(".")
        if not sep or not path or "" in steps:
            raise ConfigError(f"override: expected 'dotted.path=value', found {text!r}")
        result = _set_at(result, Any, steps, 0, raw, decoder, "")
    return result


def _set_at(
    node: Any, declared: object, steps: list[str], index: int, raw: str, decoder: Decoder, path: str
) -> Any:
    """``node`` with ``steps[index:]`` set to the parsed ``raw``; rebuilt along the path only."""
    step = steps[index]
    child_path = join_path(path, step)
    last = index == len(steps) - 1

    def new_value(current: object, annotation: object) -> object:
        if last:
            return parse_text(raw, annotation, child_path, decoder)
        return _set_at(current, annotation, steps, index + 1, raw, decoder, child_path)

    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return _set_field(node, step, path, new_value)
    if isinstance(node, (list, tuple)):
        return _set_item(node, declared, step, child_path, new_value)
    if isinstance(node, dict):
        return _set_entry(node, declared, step, child_path, last, decoder, new_value)
    if node is None:
        raise ConfigError(
            f"is None; cannot set {'.'.join(steps)} below it (set it first)", path=path
        )
    raise ConfigError(
        f"cannot set {step!r}: expected a config, list, tuple or dict, found {describe(node)}",
        path=path,
    )


#: ``(current value, declared type) -> new value`` of the step being set.
_NewValue = Callable[[object, object], object]


def _set_field(node: Any, step: str, path: str, new_value: _NewValue) -> Any:
    """A copy of the config ``node`` whose field ``step`` holds ``new_value(...)``."""
    cls = type(node)
    child_path = join_path(path, step)
    fields = init_fields(cls)
    if step not in fields:
        every = {f.name for f in dataclasses.fields(cls)}
        if step in every:
            raise ConfigError(
                f"field {step!r} of {format_type(cls)} is init=False and cannot be overridden",
                path=child_path,
            )
        raise ConfigError(
            f"unknown field {step!r} for {format_type(cls)}{did_you_mean(step, fields)}",
            path=child_path,
        )
    value = new_value(getattr(node, step), resolved_field_types(cls)[step])
    try:
        with checked_elsewhere():  # the value was parsed by this field's annotation
            return dataclasses.replace(node, **{step: value})
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise relocate(err, path) from err
        raise ConfigError(f"{format_type(cls)} rejected the value: {err}", path=child_path) from err


def _set_item(
    node: list[Any] | tuple[Any, ...], declared: object, step: str, path: str, new_value: _NewValue
) -> list[Any] | tuple[Any, ...]:
    """A copy of the list or tuple ``node`` whose item ``step`` (an index) is replaced."""
    if not step.isdigit():
        raise ConfigError(f"expected a list index, found {step!r}", path=path)
    position = int(step)
    if position >= len(node):
        raise ConfigError(
            f"expected an index below {len(node)} (length of the {type(node).__name__}), "
            f"found {position}",
            path=path,
        )
    items = list(node)
    items[position] = new_value(node[position], item_type(declared, position))
    return tuple(items) if isinstance(node, tuple) else items


def _set_entry(
    node: dict[Any, Any],
    declared: object,
    step: str,
    path: str,
    last: bool,
    decoder: Decoder,
    new_value: _NewValue,
) -> dict[Any, Any]:
    """A copy of the dict ``node`` whose entry ``step`` is replaced (added when it is the last step)."""
    key_type, value_type = mapping_types(declared)
    key = _find_key(node, step)
    if key is _MISSING:
        if not last:
            names = [_key_text(k) for k in node]
            raise ConfigError(f"unknown key {step!r}{did_you_mean(step, names)}", path=path)
        key = parse_text(step, key_type, path, decoder)  # a new entry
    out = dict(node)
    out[key] = new_value(node.get(key), value_type)
    return out


_MISSING = object()


def _key_text(key: object) -> str:
    if isinstance(key, enum.Enum):
        return str(key.value) if isinstance(key.value, str) else key.name
    return str(key)


def _find_key(mapping: dict[Any, Any], step: str) -> object:
    if step in mapping:
        return step
    for key in mapping:
        if _key_text(key) == step or (isinstance(key, enum.Enum) and key.name == step):
            return key
    return _MISSING


def parse_text(text: str, declared: object, path: str, decoder: Decoder) -> Any:
    """``text`` parsed by the annotation ``declared`` (see Config.apply_overrides for the rules)."""
    ann = strip_annotated(declared)
    stripped = text.strip()
    codec = leaf_codec(declared)
    if codec is not None:
        try:
            data: object = json.loads(stripped)
        except ValueError:
            data = stripped
        return decode_leaf(codec, data, path)
    if is_any(ann):
        try:
            return decoder.decode(json.loads(stripped), Any, path)
        except ValueError:
            return text
    if ann is None or ann is type(None):
        if stripped.lower() in _NONE:
            return None
        raise _bad(path, ann, text)
    members = union_members(ann)
    if members is not None:
        if type(None) in members and stripped.lower() in _NONE:
            return None
        # str accepts any text, so it is tried last: `int | str` reads "3" as 3.
        ordered = [m for m in members if m is not str and m is not type(None)]
        ordered += [m for m in members if m is str]
        errors: list[ConfigError] = []
        for member in ordered:
            try:
                return parse_text(text, member, path, decoder)
            except ImportRefused:
                raise
            except ConfigError as err:
                errors.append(err)
        raise union_error(errors, path, _bad(path, ann, text))
    origin = typing.get_origin(ann)
    if origin is Literal:
        for option in typing.get_args(ann):
            try:
                parsed = parse_text(text, type(option), path, decoder)
            except ConfigError:
                continue
            if parsed == option:
                return option
        raise _bad(path, ann, text)
    if origin in (*SEQUENCE_ORIGINS, tuple) or ann in (*SEQUENCE_ORIGINS, tuple):
        return _parse_sequence(stripped, ann, path, decoder)
    if origin is type or ann is collections.abc.Callable or origin is collections.abc.Callable:
        if stripped.startswith("{"):
            return decoder.resolve_callable(_json(stripped, ann, path), ann, path)
        return decoder.resolve_callable(stripped, ann, path)
    if origin in MAPPING_ORIGINS or ann in MAPPING_ORIGINS:
        return decoder.decode(_json(stripped, ann, path), ann, path)
    if not isinstance(ann, type):
        raise ConfigError(f"unsupported annotation {ann!r}", path=path)
    if issubclass(ann, enum.Enum):
        return _parse_enum(stripped, ann, path)
    if ann is bool:
        lowered = stripped.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
        raise ConfigError(f"expected bool (true/false/1/0/yes/no), found {text!r}", path=path)
    if ann is int:
        if _INT.fullmatch(stripped):
            return int(stripped)
        raise _bad(path, ann, text)
    if ann is float:
        try:
            return float(stripped)
        except ValueError:
            raise _bad(path, ann, text) from None
    if ann is str:
        if len(stripped) >= 2 and stripped[0] == stripped[-1] == '"':
            try:
                return str(json.loads(stripped))  # a JSON string: lets "none" stay a str
            except ValueError:
                pass
        return text
    return decoder.decode(_json(stripped, ann, path), ann, path)


def _parse_sequence(stripped: str, ann: object, path: str, decoder: Decoder) -> Any:
    is_tuple = typing.get_origin(ann) is tuple or ann is tuple
    if stripped.startswith("["):
        try:
            return decoder.decode(json.loads(stripped), ann, path)
        except json.JSONDecodeError:
            stripped = stripped[1:-1] if stripped.endswith("]") else stripped[1:]
    parts = [p.strip() for p in stripped.split(",")] if stripped else []
    if is_tuple:
        args = typing.get_args(ann)
        if args and args[-1] is not Ellipsis and args != ((),) and len(args) != len(parts):
            raise ConfigError(
                f"expected {format_type(ann)} ({len(args)} items), found {len(parts)} items "
                f"{stripped!r}",
                path=path,
            )
    items = [
        parse_text(p, item_type(ann, i), join_path(path, i), decoder) for i, p in enumerate(parts)
    ]
    return tuple(items) if is_tuple else items


def _parse_enum(stripped: str, cls: type[enum.Enum], path: str) -> enum.Enum:
    if stripped in cls.__members__:
        return cls.__members__[stripped]
    for member in cls:
        if str(member.value) == stripped:
            return member
    for name, member in cls.__members__.items():
        if name.lower() == stripped.lower():
            return member
    names = ", ".join(f"{m.name} ({m.value!r})" for m in cls)
    raise ConfigError(f"expected {format_type(cls)}: one of {names}, found {stripped!r}", path=path)


def _json(stripped: str, ann: object, path: str) -> object:
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        raise ConfigError(
            f"expected JSON for {format_type(ann)}, found {stripped!r}", path=path
        ) from None


def _bad(path: str, ann: object, text: str) -> ConfigError:
    return ConfigError(f"expected {format_type(ann)}, found {text!r}", path=path)

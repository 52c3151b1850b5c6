"""Checking a Config's field values against their annotations when it is constructed."""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import dataclasses
import enum
import sys
import typing
import weakref
from collections.abc import Iterator, Mapping
from typing import Literal

from hyper_parallel.config._annotations import (
    MAPPING_ORIGINS,
    SEQUENCE_ORIGINS,
    format_type,
    init_fields,
    is_any,
    resolved_field_types,
    strip_annotated,
    union_members,
)
from hyper_parallel.config.errors import (
    ConfigError,
    ConfigTypeError,
    describe,
    join_path,
    union_error,
)
from hyper_parallel.config.leaf_codec import leaf_codec

__all__ = ["check_fields", "check_value", "checked_elsewhere"]

# Field name -> annotation for the fields whose annotation resolves (a Config declared in a
# function may name local classes in string annotations; those fields are not checked).
_CHECKABLE: weakref.WeakKeyDictionary[type, dict[str, object]] = weakref.WeakKeyDictionary()


# Set while from_dict / apply_overrides construct nodes from values they already coerced
# by the same annotations: checking them again would only cost time.
_CHECKED_ELSEWHERE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hp_config_checked_elsewhere", default=False
)


@contextlib.contextmanager
def checked_elsewhere() -> Iterator[None]:
    """Within the block, :func:`check_fields` trusts the values (the caller checked them)."""
    token = _CHECKED_ELSEWHERE.set(True)
    try:
        yield
    finally:
        _CHECKED_ELSEWHERE.reset(token)


def check_fields(config: object) -> None:
    """Raise :class:`ConfigTypeError` for the first init field of ``config`` whose value does not fit.

    Example::

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Box:
        ...     size: int = 1
        >>> check_fields(Box(size="2"))
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigTypeError: size: expected int, found str '2'
    """
    if _CHECKED_ELSEWHERE.get():
        return
    cls = type(config)
    for name, annotation in _checkable_types(cls).items():
        check_value(getattr(config, name), annotation, name)


def _checkable_types(cls: type) -> dict[str, object]:
    found = _CHECKABLE.get(cls)
    if found is not None:
        return found
    names = init_fields(cls)
    try:
        hints = resolved_field_types(cls)
        found = {n: hints[n] for n in names}
    except ConfigError:
        found = {}
        module = sys.modules.get(cls.__module__)
        scope = dict(vars(module)) if module is not None else {}
        for name, f in names.items():
            annotation = f.type
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, scope, dict(vars(cls)))
                except Exception:
                    continue  # names a class local to a function: cannot be checked
            found[name] = annotation
    _CHECKABLE[cls] = found
    return found


def check_value(value: object, annotation: object, path: str) -> None:
    """Raise :class:`ConfigTypeError` (naming ``path``) unless ``value`` fits ``annotation``.

    Nested configs and other dataclasses are checked by type only (they checked their own
    fields when they were made).

    Example::

        >>> check_value([1, 2], list[int], "sizes")
        >>> check_value([1, "2"], list[int], "sizes")
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigTypeError: sizes.1: expected int, found str '2'
    """
    _Checker().check(value, annotation, path)


class _Checker:
    def __init__(self) -> None:
        self._active: set[int] = set()

    def check(self, value: object, annotation: object, path: str) -> None:
        codec = leaf_codec(annotation)
        if codec is not None:
            if not isinstance(value, codec.type):
                raise ConfigTypeError(
                    f"expected {codec.expected}, found {describe(value)}", path=path
                )
            return
        ann = strip_annotated(annotation)
        if is_any(ann) or isinstance(ann, (str, typing.ForwardRef)):
            return
        if ann is None or ann is type(None):
            if value is not None:
                raise _mismatch(path, ann, value)
            return
        members = union_members(ann)
        if members is not None:
            self._check_union(value, ann, members, path)
            return
        origin = typing.get_origin(ann)
        if origin is Literal:
            if not any(type(o) is type(value) and o == value for o in typing.get_args(ann)):
                raise _mismatch(path, ann, value)
            return
        if origin is type:
            (bound,) = typing.get_args(ann) or (object,)
            base = bound if isinstance(bound, type) else object
            if not (isinstance(value, type) and issubclass(value, base)):
                raise _mismatch(path, ann, value)
            return
        if ann is collections.abc.Callable or origin is collections.abc.Callable:
            if not callable(value):
                raise ConfigTypeError(
                    f"expected a callable ({format_type(ann)}), found {describe(value)}", path=path
                )
            return
        if origin in SEQUENCE_ORIGINS or ann in SEQUENCE_ORIGINS or origin is tuple or ann is tuple:
            self._check_sequence(value, ann, origin, path)
            return
        if origin in MAPPING_ORIGINS or ann in MAPPING_ORIGINS:
            self._check_mapping(value, ann, origin, path)
            return
        target = origin if origin is not None else ann
        if not isinstance(target, type):
            return  # an annotation form this checker does not know: accept, as Python does
        if not _is_instance(value, target):
            raise _mismatch(path, ann, value)

    def _check_union(
        self, value: object, ann: object, members: tuple[object, ...], path: str
    ) -> None:
        errors: list[ConfigError] = []
        for member in members:
            try:
                self.check(value, member, path)
                return
            except ConfigError as err:
                errors.append(err)
        raise union_error(errors, path, _mismatch(path, ann, value))

    def _check_sequence(self, value: object, ann: object, origin: object, path: str) -> None:
        container = origin if origin is not None else ann
        if container is tuple:
            if not isinstance(value, tuple):
                raise _mismatch(path, ann, value)
        elif container is list:
            if not isinstance(value, list):
                raise _mismatch(path, ann, value)
        elif not isinstance(value, (list, tuple)):
            raise _mismatch(path, ann, value)
        assert isinstance(value, (list, tuple))
        args = typing.get_args(ann)
        if not args or args == ((),) or id(value) in self._active:
            return
        if container is tuple and args[-1] is not Ellipsis and len(args) != len(value):
            raise ConfigTypeError(
                f"expected {format_type(ann)} ({len(args)} items), found {len(value)} items "
                f"{describe(value)}",
                path=path,
            )
        self._active.add(id(value))
        try:
            fixed = container is tuple and args[-1] is not Ellipsis
            for i, item in enumerate(value):
                self.check(item, args[i] if fixed else args[0], join_path(path, i))
        finally:
            self._active.discard(id(value))

    def _check_mapping(self, value: object, ann: object, origin: object, path: str) -> None:
        container = origin if origin is not None else ann
        if not isinstance(value, dict if container is dict else Mapping):
            raise _mismatch(path, ann, value)
        assert isinstance(value, Mapping)
        args = typing.get_args(ann)
        if len(args) != 2 or id(value) in self._active:
            return
        key_ann, value_ann = args
        self._active.add(id(value))
        try:
            for key, item in value.items():
                self.check(key, key_ann, join_path(path, key))
                self.check(item, value_ann, join_path(path, key))
        finally:
            self._active.discard(id(value))


def _is_instance(value: object, cls: type) -> bool:
    if cls is bool:
        return isinstance(value, bool)
    if cls is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if cls is float:  # an int is a fine float, as for Python's own type checkers
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls):
        return isinstance(value, cls)
    try:
        return isinstance(value, cls)
    except TypeError:  # e.g. a Protocol that is not runtime_checkable
        return True


def _mismatch(path: str, ann: object, value: object) -> ConfigTypeError:
    return ConfigTypeError(f"expected {format_type(ann)}, found {describe(value)}", path=path)

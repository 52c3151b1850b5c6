"""JSON data -> config trees: annotation-driven from_dict decoding, imports under an allowlist."""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, cast

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
from hyper_parallel.config._check import checked_elsewhere
from hyper_parallel.config._json_form import (
    CALLABLE_TAG,
    PARTIAL_TAG,
    TYPE_TAG,
    _import_attribute,
    item_type,
    mapping_types,
)
from hyper_parallel.config.errors import (
    ConfigError,
    describe,
    did_you_mean,
    join_path,
    relocate,
    union_error,
)
from hyper_parallel.config.leaf_codec import LeafCodec, leaf_codec

__all__ = ["Decoder", "ImportRefused", "decode_leaf", "module_allowed"]


def _type_bound(declared: object) -> type | None:
    """``X`` for ``type[X]`` annotations, else None."""
    if typing.get_origin(declared) is type:
        (arg,) = typing.get_args(declared)
        return arg if isinstance(arg, type) else object
    return None


class ImportRefused(ConfigError):
    """A ``"module:qualname"`` outside the allowlist: raised as is, never folded into a union error."""


def module_allowed(module: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``allowed`` or inside one of them (``a`` allows ``a.b``)."""
    return any(module == name or module.startswith(name + ".") for name in allowed)


class Decoder:
    """Decodes JSON data by annotations; ``any_base`` bounds ``_type_`` tags under ``Any``.

    ``allow_imports``: when given, ``"module:qualname"`` strings and ``_type_`` tags resolve
    only from these modules and their submodules; anything else is a ConfigError naming the
    key and the module (a config file is data, not code).
    """

    def __init__(self, any_base: type, allow_imports: Iterable[str] | None = None) -> None:
        self.any_base = any_base
        self.allow_imports = None if allow_imports is None else tuple(allow_imports)
        self._tags: dict[tuple[type, str], type] = {}

    def check_import(self, module: str, ref: str, path: str) -> None:
        """Refuse ``ref`` (from ``module``) when an allowlist is set and does not hold ``module``."""
        if self.allow_imports is not None and not module_allowed(module, self.allow_imports):
            raise ImportRefused(
                f"refusing to import {ref!r}: module {module!r} is not on the allowlist "
                f"({self._allowed()}); a config names callables only "
                "from these modules (allow another with --allow-import MODULE)",
                path=path,
            )

    def _allowed(self) -> str:
        return ", ".join(self.allow_imports or ()) or "empty"

    def import_allowed(self, module: str, qualname: str, ref: str, path: str) -> object:
        """What ``module:qualname`` names, checked by what it resolves to, not by its text.

        With an allowlist, the walk along ``qualname`` may not pass through a module off
        it (``torch.nn.functional:torch.os.system`` reaches ``os``), and the object found must
        be defined in an allowed module (its ``__module__``): a function an allowed module
        merely imported from elsewhere is refused. The one exception: a compiled builtin
        of the named module's own package (``torch.nn.functional:gelu`` is
        ``torch._C._nn.gelu``).
        """
        self.check_import(module, ref, path)
        try:
            obj: object = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
                if (
                    isinstance(obj, types.ModuleType)
                    and self.allow_imports is not None
                    and not module_allowed(obj.__name__, self.allow_imports)
                ):
                    raise ImportRefused(
                        f"refusing to import {ref!r}: {qualname!r} passes through module "
                        f"{obj.__name__!r} (name callables as 'module:function' of a module on "
                        f"the allowlist: {self._allowed()})",
                        path=path,
                    )
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"cannot import {ref!r}: {err}", path=path) from err
        if self.allow_imports is None:
            return obj
        home = getattr(obj, "__module__", None)
        if isinstance(home, str) and module_allowed(home, self.allow_imports):
            return obj
        own_kernel = (
            inspect.isbuiltin(obj)
            and isinstance(home, str)
            and home.split(".")[0] == module.split(".")[0]
        )
        if own_kernel:
            return obj
        raise ImportRefused(
            f"refusing to import {ref!r}: it is {home}:{getattr(obj, '__qualname__', '?')}, "
            f"defined in module {home!r}, which is not on the allowlist ({self._allowed()}); "
            "a config names callables only as defined in these modules (allow another with "
            "--allow-import MODULE)",
            path=path,
        )

    def decode(self, data: object, declared: object, path: str) -> Any:
        """``data`` coerced to ``declared``; ConfigError (path, expected, found) when it does not fit."""
        codec = leaf_codec(declared)
        if codec is not None:
            return decode_leaf(codec, data, path)
        ann = strip_annotated(declared)
        if is_any(ann):
            return self._decode_any(data, path)
        if ann is None or ann is type(None):
            if data is None:
                return None
            raise _mismatch(path, ann, data)
        members = union_members(ann)
        if members is not None:
            return self._decode_union(data, ann, members, path)
        origin = typing.get_origin(ann)
        if origin is Literal:
            for option in typing.get_args(ann):
                if type(option) is type(data) and option == data:
                    return option
            raise _mismatch(path, ann, data)
        if origin in SEQUENCE_ORIGINS or ann in SEQUENCE_ORIGINS:
            if not isinstance(data, (list, tuple)):
                raise _mismatch(path, ann, data)
            item = item_type(ann, 0)
            return [self.decode(v, item, join_path(path, i)) for i, v in enumerate(data)]
        if origin is tuple or ann is tuple:
            return self._decode_tuple(data, ann, path)
        if origin in MAPPING_ORIGINS or ann in MAPPING_ORIGINS:
            if not isinstance(data, Mapping):
                raise _mismatch(path, ann, data)
            key_type, value_type = mapping_types(ann)
            return {
                self._decode_key(k, key_type, path): self.decode(v, value_type, join_path(path, k))
                for k, v in data.items()
            }
        if origin is type or ann is collections.abc.Callable or origin is collections.abc.Callable:
            return self.resolve_callable(data, ann, path)
        if not isinstance(ann, type):
            raise ConfigError(f"unsupported annotation {ann!r}", path=path)
        return self._decode_class(data, ann, path)

    def resolve_callable(self, ref: object, declared: object, path: str) -> object:
        """The callable named by ``"module:qualname"`` (or a tagged dict), checked against ``declared``."""
        if isinstance(ref, Mapping) and PARTIAL_TAG in ref:
            extra = set(ref) - {PARTIAL_TAG, "args", "kwargs"}
            if extra:
                raise ConfigError(
                    f"unknown keys {sorted(extra)} in a {PARTIAL_TAG} entry; expected args, kwargs",
                    path=path,
                )
            func = self.resolve_callable(ref[PARTIAL_TAG], Callable, path)
            args = self.decode(ref.get("args", []), list[Any], join_path(path, "args"))
            kwargs = self.decode(ref.get("kwargs", {}), dict[str, Any], join_path(path, "kwargs"))
            return functools.partial(cast(Callable[..., object], func), *args, **kwargs)
        if isinstance(ref, Mapping) and set(ref) == {CALLABLE_TAG}:
            ref = ref[CALLABLE_TAG]
        if not isinstance(ref, str) or ref.count(":") != 1:
            raise ConfigError(
                f"expected an importable callable as 'module:qualname', found {describe(ref)}",
                path=path,
            )
        module, qualname = ref.split(":")
        obj = self.import_allowed(module, qualname, ref, path)
        base = _type_bound(declared)
        if base is not None:
            if not (isinstance(obj, type) and issubclass(obj, base)):
                raise ConfigError(
                    f"expected a subclass of {format_type(base)}, found {describe(obj)}", path=path
                )
        elif not callable(obj):
            raise ConfigError(f"expected a callable, found {describe(obj)}", path=path)
        return obj

    def _decode_class(self, data: object, cls: type, path: str) -> Any:
        if issubclass(cls, enum.Enum):
            return _decode_enum(data, cls, path)
        if cls is bool:
            if isinstance(data, bool):
                return data
            raise _mismatch(path, cls, data)
        if cls is int:
            if isinstance(data, int) and not isinstance(data, bool):
                return data
            raise _mismatch(path, cls, data)
        if cls is float:
            if isinstance(data, (int, float)) and not isinstance(data, bool):
                return float(data)
            raise _mismatch(path, cls, data)
        if cls is str:
            if isinstance(data, str):
                return data
            raise _mismatch(path, cls, data)
        if isinstance(data, Mapping) and (dataclasses.is_dataclass(cls) or TYPE_TAG in data):
            return self.decode_dataclass(data, cls, path)
        if isinstance(data, cls) and not isinstance(data, (dict, list)):
            return data
        raise _mismatch(path, cls, data)

    def decode_dataclass(self, data: object, declared: type, path: str) -> Any:
        """An instance of ``declared`` (or the subclass its ``_type_`` tag names) from a dict."""
        if not isinstance(data, Mapping):
            raise _mismatch(path, declared, data)
        cls = declared
        if TYPE_TAG in data:
            cls = self.resolve_tag(data[TYPE_TAG], declared, join_path(path, TYPE_TAG))
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"expected a dataclass type, found {format_type(cls)}", path=path)
        fields = init_fields(cls)
        unknown = [k for k in data if k not in fields and k != TYPE_TAG]
        if unknown:
            key = str(unknown[0])
            raise ConfigError(
                f"unknown field {key!r} for {format_type(cls)}{did_you_mean(key, fields)}",
                path=join_path(path, key),
            )
        hints = resolved_field_types(cls)
        kwargs = {
            name: self.decode(value, hints[name], join_path(path, name))
            for name, value in data.items()
            if name != TYPE_TAG
        }
        missing = [
            name
            for name, f in fields.items()
            if name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(
                f"missing required field(s) {', '.join(map(repr, missing))} of {format_type(cls)}",
                path=path,
            )
        try:
            with checked_elsewhere():  # every value was just decoded by its annotation
                return cls(**kwargs)
        except (TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise relocate(err, path) from err
            raise ConfigError(
                f"{format_type(cls)}(...) rejected the values: {err}", path=path
            ) from err

    def resolve_tag(self, tag: object, declared: type, path: str) -> type:
        """The class a ``_type_`` tag names, which must be ``declared`` or a subclass of it."""
        if not isinstance(tag, str) or tag.count(":") != 1:
            raise ConfigError(f"expected 'module:QualName', found {describe(tag)}", path=path)
        cached = self._tags.get((declared, tag))
        if cached is not None:
            return cached
        module, qualname = tag.split(":")
        self.check_import(module, tag, path)
        found = _find_subclass(declared, module, qualname)
        if found is None and "<" not in qualname:
            try:  # the module defining the subclass may not be imported yet
                importlib.import_module(module)
            except ImportError as err:
                raise ConfigError(f"cannot import module {module!r}: {err}", path=path) from err
            found = _find_subclass(declared, module, qualname)
        if found is None:
            raise ConfigError(
                f"expected {format_type(declared)} or a subclass of it, found {tag!r} "
                "(tags only name subclasses of the declared type)",
                path=path,
            )
        self._tags[(declared, tag)] = found
        return found

    def _decode_any(self, data: object, path: str) -> Any:
        if isinstance(data, Mapping):
            if CALLABLE_TAG in data or PARTIAL_TAG in data:
                return self.resolve_callable(data, Callable, path)
            if TYPE_TAG in data:
                return self.decode_dataclass(data, self.any_base, path)
            return {k: self._decode_any(v, join_path(path, k)) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return [self._decode_any(v, join_path(path, i)) for i, v in enumerate(data)]
        return data

    def _decode_union(
        self, data: object, ann: object, members: tuple[object, ...], path: str
    ) -> Any:
        # Exact type matches first, so 1 under `float | int` stays the int 1.
        ordered = sorted(members, key=lambda m: 0 if m is type(data) else 1)
        errors: list[ConfigError] = []
        for member in ordered:
            try:
                return self.decode(data, member, path)
            except ImportRefused:
                raise
            except ConfigError as err:
                errors.append(err)
        raise union_error(errors, path, _mismatch(path, ann, data))

    def _decode_tuple(self, data: object, ann: object, path: str) -> tuple[Any, ...]:
        if not isinstance(data, (list, tuple)):
            raise _mismatch(path, ann, data)
        args = typing.get_args(ann)
        if args and args[-1] is not Ellipsis and len(args) != len(data):
            raise ConfigError(
                f"expected {format_type(ann)} ({len(args)} items), found {len(data)} items "
                f"{describe(data)}",
                path=path,
            )
        return tuple(
            self.decode(v, item_type(ann, i), join_path(path, i)) for i, v in enumerate(data)
        )

    def _decode_key(self, key: object, key_type: object, path: str) -> object:
        key_type = strip_annotated(key_type)
        if isinstance(key_type, type) and issubclass(key_type, enum.Enum):
            return _decode_enum(key, key_type, join_path(path, key))
        if key_type is int and isinstance(key, str) and key.lstrip("-").isdigit():
            return int(key)  # JSON object keys are always strings
        return self.decode(key, key_type, join_path(path, key))


def decode_leaf(codec: LeafCodec, data: object, path: str) -> Any:
    """``codec.decode(data)``, its errors as a ConfigError naming ``path`` and what was expected."""
    if isinstance(data, codec.type):
        return data
    try:
        return codec.decode(data)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"expected {codec.expected}, found {describe(data)} ({err})", path=path
        ) from err


def _find_subclass(base: type, module: str, qualname: str) -> type | None:
    # slots=True dataclasses leave the pre-slots class alive (as a subclass too); prefer the
    # importable one, then the slotted one.
    matches = [
        c for c in _all_subclasses(base) if c.__module__ == module and c.__qualname__ == qualname
    ]
    if not matches:
        return None
    try:
        importable = _import_attribute(module, qualname)
    except (ImportError, AttributeError):
        importable = None
    for cls in matches:
        if cls is importable:
            return cls
    slotted = [c for c in matches if "__slots__" in c.__dict__]
    return (slotted or matches)[-1]


def _all_subclasses(base: type) -> list[type]:
    seen: list[type] = [base]
    index = 0
    while index < len(seen):
        subclasses: list[type] = type.__subclasses__(seen[index])
        for sub in subclasses:
            if sub not in seen:
                seen.append(sub)
        index += 1
    return seen


def _decode_enum(data: object, cls: type[enum.Enum], path: str) -> enum.Enum:
    for member in cls:
        if type(member.value) is type(data) and member.value == data:
            return member
    if isinstance(data, str) and data in cls.__members__:
        return cls.__members__[data]
    names = ", ".join(f"{m.name} ({m.value!r})" for m in cls)
    raise ConfigError(
        f"expected {format_type(cls)}: one of {names}, found {describe(data)}", path=path
    )


def _mismatch(path: str, ann: object, data: object) -> ConfigError:
    return ConfigError(f"expected {format_type(ann)}, found {describe(data)}", path=path)

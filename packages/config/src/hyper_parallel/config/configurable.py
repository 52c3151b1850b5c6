"""Configurable and its nested Config: typed dataclass configs bound to the class they build."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias, TypeVar, overload

from hyper_parallel.config._annotations import format_type, init_fields, resolved_field_types
from hyper_parallel.config._check import check_fields
from hyper_parallel.config._codec import Decoder, JSONValue, encode
from hyper_parallel.config._overrides import apply_overrides
from hyper_parallel.config._tree import copy_tree, walk_configs
from hyper_parallel.config.errors import ConfigError, UnboundConfigError, did_you_mean

__all__ = ["Configurable", "TraverseKey", "TraverseParent", "enforce_module_config_slots"]

_C = TypeVar("_C", bound="Configurable.Config")
_N = TypeVar("_N", bound="Configurable.Config")

TraverseParent: TypeAlias = (
    "Configurable.Config | list[Any] | tuple[Any, ...] | dict[Any, Any] | None"
)
"""What holds a traversed node: a config, list, tuple or dict (``None`` for the root)."""
TraverseKey: TypeAlias = "str | int | Hashable | None"
"""Where the node sits in its parent: field name, list/tuple index or dict key."""

# Class attribute naming the Configurable a Config builds; looked up through the MRO, so a
# Config subclass declared outside any owner (a preset) builds what its parent builds.
_OWNER = "_hp_owner"


class Configurable:
    """Base of classes that are built from a nested, declarative ``Config``.

    Declaring ``class Config(Parent.Config)`` inside a subclass binds that Config to the
    subclass: ``Config().build(**runtime_kwargs)`` returns ``Owner(config=<copy>, **kwargs)``.
    A subclass that declares no Config inherits its parent's, which stays bound to the parent
    (so ``Child.Config is Parent.Config`` and it builds a ``Parent``). Binding happens in
    ``__init_subclass__`` -- no metaclass -- so ``class Module(nn.Module, Configurable)`` works.

    Example::

        >>> from dataclasses import dataclass
        >>> class Linear(Configurable):
        ...     @dataclass(kw_only=True, slots=True)
        ...     class Config(Configurable.Config):
        ...         dim: int = 8
        ...     def __init__(self, *, config: Config, bias: bool = True) -> None:
        ...         self.config, self.bias = config, bias
        >>> layer = Linear.Config(dim=4).build(bias=False)
        >>> type(layer).__name__, layer.config.dim, layer.bias
        ('Linear', 4, False)
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config:
        """Base of all configs: a keyword-only, slotted dataclass with tree operations.

        Subclasses may override an inherited field with a plain class attribute
        (``dim = 16``) and may use mutable defaults (``layers = [Block.Config()]``): each
        instance then gets its own copy (see README, "Declaring configs").

        Example::

            >>> Configurable.Config().to_dict()
            {}
        """

        def __init_subclass__(cls, **kwargs: Any) -> None:
            # Zero-argument super() breaks in slots dataclasses (the class is re-created).
            super(Configurable.Config, cls).__init_subclass__(**kwargs)
            _declare_field_overrides(cls)

        def __post_init__(self) -> None:
            """Check every field's value against its annotation, then run :meth:`validate`.

            Runs for the constructor, ``replace``, ``from_dict`` and ``apply_overrides``, so a
            wrong-typed value is a :class:`~hyper_parallel.config.ConfigTypeError` naming the
            field before the config exists. A subclass defining its own ``__post_init__``
            calls ``Configurable.Config.__post_init__(self)``.
            """
            check_fields(self)
            self.validate()

        def validate(self) -> None:
            """Hook: raise ``ConfigError(message, path=field)`` for values that type-check but make no sense.

            Called after the type checks. Overrides call their parent's ``validate`` first
            (``Parent.Config.validate(self)``: ``super()`` fails in slots dataclasses).

            Example::

                >>> from dataclasses import dataclass
                >>> class Attention(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         heads: int = 4
                ...         def validate(self) -> None:
                ...             if self.heads < 1:
                ...                 raise ConfigError(f"expected >= 1, found {self.heads}", path="heads")
                >>> Attention.Config(heads=0)
                Traceback (most recent call last):
                ...
                hyper_parallel.config.errors.ConfigError: heads: expected >= 1, found 0
            """

        def build(self, **runtime_kwargs: Any) -> Any:
            """Construct the owner: ``Owner(config=<deep copy of self>, **runtime_kwargs)``.

            The copy is deep for configs, lists, dicts and sets, so the built object shares no
            mutable config state with ``self``; callables, placements and other leaves are
            passed as they are. Subclasses that override ``build`` call the base explicitly
            (``Parent.Config.build(self, **kwargs)``) because ``super()`` fails in slots
            dataclasses before Python 3.14.

            Example::

                >>> from dataclasses import dataclass
                >>> class Net(Configurable):
                ...     @dataclass(kw_only=True, slots=True)
                ...     class Config(Configurable.Config):
                ...         sizes: list[int] = [1, 2]  # copied per instance
                ...     def __init__(self, *, config: Config) -> None:
                ...         self.config = config
                >>> template = Net.Config()
                >>> template.build().config.sizes is template.sizes
                False
            """
            cls = type(self)
            owner = getattr(cls, _OWNER, None)
            if owner is None:
                raise UnboundConfigError(
                    f"{format_type(cls)} has no owner to build: expected a Config declared "
                    f"inside a Configurable subclass (or a subclass of one), found "
                    f"{cls.__module__}:{cls.__qualname__} bound to nothing"
                )
            clashes = sorted(n for n in runtime_kwargs if n in init_fields(cls) or n == "config")
            if clashes:
                raise ConfigError(
                    f"{format_type(cls)}.build(): expected runtime-only keyword arguments, found "
                    f"{', '.join(map(repr, clashes))} naming config fields (they overlap the "
                    f"Config: set them with .replace(...) before build; 'config' is passed by "
                    f"build itself)"
                )
            return owner(config=copy_tree(self), **runtime_kwargs)

        def replace(self: _C, **changes: Any) -> _C:
            """A deep copy of this config with ``changes`` applied to its fields.

            Example::

                >>> Configurable.Config().replace()
                Configurable.Config()
            """
            cls = type(self)
            fields = init_fields(cls)
            for name in changes:
                if name not in fields:
                    raise ConfigError(
                        f"unknown field {name!r} for {format_type(cls)}{did_you_mean(name, fields)}",
                        path=name,
                    )
            return dataclasses.replace(copy_tree(self), **changes)

        @overload
        def traverse(
            self,
        ) -> Iterator[tuple[str, Configurable.Config, TraverseParent, TraverseKey]]: ...

        @overload
        def traverse(
            self, config_cls: type[_N]
        ) -> Iterator[tuple[str, _N, TraverseParent, TraverseKey]]: ...

        def traverse(
            self, config_cls: type[Any] | None = None
        ) -> Iterator[tuple[str, Any, TraverseParent, TraverseKey]]:
            """Yield ``(fqn, config, parent, key)`` for each nested ``config_cls`` instance.

            Pre-order through fields, lists, tuples and dicts; the root has fqn ``""`` and
            parent/key ``None``. Replacing a node in place while iterating is supported
            (``setattr(parent, key, new)`` or ``parent[key] = new``); tuples cannot be.

            Example::

                >>> [fqn for fqn, *_ in Configurable.Config().traverse()]
                ['']
            """
            wanted = Configurable.Config if config_cls is None else config_cls
            for fqn, node, parent, key in walk_configs(self, Configurable.Config):
                if isinstance(node, wanted):
                    yield fqn, node, parent, key

        def to_dict(self) -> dict[str, JSONValue]:
            """JSON-compatible data for this config (see README, "Data format").

            Example::

                >>> Configurable.Config().to_dict()
                {}
            """
            data = encode(self, type(self), "")
            assert isinstance(data, dict)
            return data

        @classmethod
        def from_dict(
            cls: type[_C], data: Mapping[str, object], *, allow_imports: Iterable[str] | None = None
        ) -> _C:
            """Rebuild a config from ``to_dict`` data, coercing values by the annotations.

            ``allow_imports``: when given, callables (``"module:qualname"``) and ``_type_`` tags
            resolve only from these modules and their submodules (a ConfigError otherwise).

            Example::

                >>> Configurable.Config.from_dict({})
                Configurable.Config()
            """
            decoder = Decoder(Configurable.Config, allow_imports)
            decoded: _C = decoder.decode_dataclass(data, cls, "")
            return decoded

        def apply_overrides(
            self: _C, overrides: Iterable[str], *, allow_imports: Iterable[str] | None = None
        ) -> _C:
            """A new config with ``"dotted.path=value"`` overrides parsed by the annotations.

            ``allow_imports`` as in :meth:`from_dict`.

            Example::

                >>> Configurable.Config().apply_overrides([])
                Configurable.Config()
            """
            return apply_overrides(self, overrides, Decoder(Configurable.Config, allow_imports))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is None:
            return  # keeps the parent's Config, bound to the parent
        if not (isinstance(config_cls, type) and issubclass(config_cls, Configurable.Config)):
            raise TypeError(
                f"{format_type(cls)}.Config: expected a subclass of Configurable.Config "
                f"(usually the parent's Config), found {config_cls!r}"
            )
        bound = config_cls.__dict__.get(_OWNER)
        if bound is not None and bound is not cls:
            raise TypeError(
                f"{format_type(cls)}.Config: expected a Config class of its own, found "
                f"{format_type(config_cls)}, already bound to {format_type(bound)}; declare "
                f"`class Config({format_type(config_cls)})` inside {format_type(cls)} instead"
            )
        type.__setattr__(config_cls, _OWNER, cls)


def _declare_field_overrides(cls: type) -> None:
    """Turn plain overrides of inherited fields and mutable defaults into dataclass fields.

    Runs before ``@dataclass`` processes ``cls``: ``dim = 16`` overriding an inherited field
    gets the inherited annotation (else slots would make it a read-only class attribute), and
    an unhashable default (list, dict, set, config instance) becomes a ``default_factory``
    that copies it, so instances never share it.
    """
    # The class's own annotation dict, mutated before @dataclass reads it.
    own = cls.__dict__.get("__annotations__")  # noqa: RUF063
    if own is None:
        own = {}
        type.__setattr__(cls, "__annotations__", own)
    inherited = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for name, value in list(cls.__dict__.items()):
        if name in own:
            if _is_classvar(own[name]):
                continue
        elif name in inherited:
            own[name] = _inherited_type(cls, name, inherited[name])
        else:
            continue
        if not isinstance(value, dataclasses.Field) and type(value).__hash__ is None:
            factory = functools.partial(copy_tree, value)
            type.__setattr__(cls, name, dataclasses.field(default_factory=factory))


def _inherited_type(cls: type, name: str, field: dataclasses.Field[Any]) -> object:
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base) and name in init_fields(base):
            try:
                return resolved_field_types(base)[name]
            except ConfigError:
                break  # forward reference not resolvable yet: keep the declared form
    return field.type


def _is_classvar(annotation: object) -> bool:
    if isinstance(annotation, str):
        return annotation.startswith(("ClassVar", "typing.ClassVar"))
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


def enforce_module_config_slots(config_cls: type, owner_name: str) -> None:
    """Raise TypeError unless ``config_cls`` is a slotted, keyword-only dataclass.

    Slots make a misspelt attribute (``cfg.dimm = 3``) an error instead of a silent no-op;
    keyword-only fields keep subclass field order from mattering.

    Example::

        >>> enforce_module_config_slots(Configurable.Config, "Configurable")
    """
    where = f"{owner_name}.Config ({getattr(config_cls, '__qualname__', config_cls)!r})"
    if not isinstance(config_cls, type) or "__dataclass_fields__" not in config_cls.__dict__:
        raise TypeError(
            f"{where}: expected a class decorated with @dataclass(kw_only=True, slots=True), "
            f"found one that is not itself a dataclass"
        )
    missing: list[str] = []
    unslotted = [format_type(c) for c in config_cls.__mro__[:-1] if "__slots__" not in c.__dict__]
    if unslotted:
        missing.append(f"__slots__ on {', '.join(unslotted)} (use slots=True)")
    positional = [f.name for f in dataclasses.fields(config_cls) if not f.kw_only]
    if positional:
        missing.append(f"keyword-only fields {', '.join(positional)} (use kw_only=True)")
    if missing:
        raise TypeError(
            f"{where}: expected @dataclass(kw_only=True, slots=True), missing " + "; ".join(missing)
        )

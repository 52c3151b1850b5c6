"""ModelSpec: a named model with its config flavors, and the registry trainers look them up in."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyper_parallel.dmodule.base_model import BaseModel, ModelConfigConverter

__all__ = ["ModelRegistry", "ModelSpec", "get_spec", "register_spec", "unregister_spec"]


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} Known: {sorted(options)}"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model a trainer can pick by name: its config flavors and an optional converter.

    Example::

        >>> spec = ModelSpec(name="tiny", flavors={"debug": BaseModel.Config()})
        >>> spec.config("debug")
        BaseModel.Config(param_init=None, sharding_config=None)
    """

    name: str
    flavors: Mapping[str, BaseModel.Config]
    converter: ModelConfigConverter[Any] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name: expected a non-empty str, found {self.name!r}")
        if not self.flavors:
            raise ValueError(f"ModelSpec {self.name!r}: expected at least one flavor, found none")
        for flavor, config in self.flavors.items():
            if not isinstance(config, BaseModel.Config):
                raise TypeError(
                    f"ModelSpec {self.name!r}: flavor {flavor!r}: expected a BaseModel.Config, "
                    f"found {type(config).__name__}"
                )

    def config(self, flavor: str) -> BaseModel.Config:
        """A copy of the config of ``flavor`` (unknown flavors raise with did-you-mean).

        Example::

            >>> spec.config("debug").build()  # doctest: +SKIP
        """
        found = self.flavors.get(flavor)
        if found is None:
            raise LookupError(
                f"model {self.name!r} has no flavor {flavor!r}"
                + _did_you_mean(flavor, list(self.flavors))
            )
        return found.replace()


class ModelRegistry:
    """Model specs by name; the module-level functions use one default registry.

    Example::

        >>> registry = ModelRegistry()
        >>> registry.register(ModelSpec(name="tiny", flavors={"debug": BaseModel.Config()}))
        >>> registry.get("tiny").name
        'tiny'
    """

    def __init__(self) -> None:
        self._specs: dict[str, ModelSpec] = {}

    def register(self, spec: ModelSpec, *, replace: bool = False) -> None:
        """Add ``spec``; a second spec under the same name raises unless ``replace=True``."""
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"register_spec: expected a ModelSpec, found {type(spec).__name__}")
        existing = self._specs.get(spec.name)
        if existing is not None and not replace and existing is not spec:
            raise ValueError(
                f"register_spec: a model named {spec.name!r} is already registered "
                f"(flavors {sorted(existing.flavors)}); pick another name or pass replace=True"
            )
        self._specs[spec.name] = spec

    def get(self, name: str) -> ModelSpec:
        """The spec registered as ``name`` (unknown names raise with did-you-mean)."""
        found = self._specs.get(name)
        if found is None:
            raise LookupError(
                f"get_spec: no model named {name!r}" + _did_you_mean(name, list(self._specs))
            )
        return found

    def unregister(self, name: str) -> None:
        """Remove the spec registered as ``name`` (unknown names raise)."""
        self.get(name)
        del self._specs[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._specs)


_default_registry = ModelRegistry()


def register_spec(spec: ModelSpec, *, replace: bool = False) -> None:
    """Register ``spec`` under ``spec.name`` in the default registry.

    Example::

        >>> register_spec(ModelSpec(name="doc-tiny", flavors={"debug": BaseModel.Config()}))
        >>> get_spec("doc-tiny").config("debug")
        BaseModel.Config(param_init=None, sharding_config=None)
        >>> unregister_spec("doc-tiny")
    """
    _default_registry.register(spec, replace=replace)


def get_spec(name: str) -> ModelSpec:
    """The spec registered as ``name`` in the default registry.

    Example::

        >>> get_spec("no-such-model")  # doctest: +SKIP
        LookupError: get_spec: no model named 'no-such-model' Known: []
    """
    return _default_registry.get(name)


def unregister_spec(name: str) -> None:
    """Remove ``name`` from the default registry.

    Example::

        >>> unregister_spec("doc-tiny")  # doctest: +SKIP
    """
    _default_registry.unregister(name)

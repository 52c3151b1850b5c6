"""ModelSpec: a named model with its config flavors, and the registry trainers look them up in."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hyper_parallel.dmodule.base_model import BaseModel, ModelConfigConverter

if TYPE_CHECKING:
    from hyper_parallel.dmodule.pipeline.split import PipelineSplit

__all__ = [
    "BUILTIN_MODELS",
    "ModelRegistry",
    "ModelSpec",
    "StateDictAdapter",
    "UnknownModelError",
    "get_spec",
    "register_spec",
    "spec_for_config",
    "unregister_spec",
]


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} Known: {sorted(options)}"


class UnknownModelError(LookupError, ValueError):
    """No model registered under a name: a ``LookupError`` and upstream's ``ValueError``.

    Example::

        >>> issubclass(UnknownModelError, ValueError), issubclass(UnknownModelError, LookupError)
        (True, True)
    """


class StateDictAdapter(Protocol):
    """What ``ModelSpec.state_dict_adapter(config)`` builds: our keys to Hugging Face's and back.

    ``to_hf``/``from_hf`` map dicts whose values pass through unchanged (so that
    ``load_hf`` can read each rank's slice of each tensor on its own). An adapter may also
    have ``hf_config() -> dict``, the ``config.json`` that ``save_hf`` writes by default;
    ``hf_stacks(fqns) -> {fqn: [hf_key, ...]}``, our tensors that are several Hugging Face
    tensors stacked along dim 0 (per-expert weights; ``load_hf`` reads only a rank's own
    rows, ``save_hf`` writes one tensor per row); and ``hf_config_problems(config_json) ->
    [str]``, how a checkpoint's ``config.json`` disagrees with the model (``load_hf``
    refuses it, naming them).
    """

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our FQNs to Hugging Face keys."""
        ...

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face keys to our FQNs."""
        ...


@dataclass
class ModelSpec:
    """A model a trainer can pick by name (upstream hyper-parallel's fields, plus ``flavors``).

    Exactly one of ``model`` (a :class:`BaseModel.Config`, built with ``model.build()``) and
    ``build_model_fn`` (a factory ``(job_config) -> nn.Module``) is set. The hooks are
    optional: ``parallelize_fn(model, mesh, job_config) -> model``, ``clip_grad_fn``,
    ``pipelining_fn(model, mesh, job_config)``, and ``state_dict_adapter``, a class that
    translates state-dict keys (e.g. to Hugging Face names). Additions here: ``flavors``
    (named configs, as TorchTitan's ``model_args``), a ``converter`` for external configs,
    a ``description`` and ``pipeline_split`` (where :func:`~hyper_parallel.dmodule.pipeline.pipeline`
    may cut the model into stages). Every field is checked when the spec is made.

    Example::

        >>> spec = ModelSpec(name="tiny", model=BaseModel.Config(),
        ...                  flavors={"debug": BaseModel.Config()})
        >>> spec.config("debug")
        BaseModel.Config(param_init=None, sharding_config=None)
    """

    name: str
    build_model_fn: Callable[..., Any] | None = None
    model: BaseModel.Config | None = None
    parallelize_fn: Callable[..., Any] | None = None
    clip_grad_fn: Callable[..., Any] | None = None
    pipelining_fn: Callable[..., Any] | None = None
    state_dict_adapter: type | None = None
    flavors: Mapping[str, BaseModel.Config] = field(default_factory=dict)
    converter: ModelConfigConverter[Any] | None = None
    description: str = ""
    pipeline_split: PipelineSplit | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name: expected a non-empty str, found {self.name!r}")
        where = f"ModelSpec {self.name!r}"
        if self.build_model_fn is None and self.model is None:
            raise ValueError(
                f"{where} requires build_model_fn or model config (found neither); set "
                "model=<BaseModel.Config> or build_model_fn=<factory>"
            )
        if self.build_model_fn is not None and self.model is not None:
            raise ValueError(f"{where} must not set both build_model_fn and model; keep one")
        if self.model is not None and not isinstance(self.model, BaseModel.Config):
            raise TypeError(
                f"{where}: model: expected a BaseModel.Config, found {type(self.model).__name__}"
            )
        for hook in ("build_model_fn", "parallelize_fn", "clip_grad_fn", "pipelining_fn"):
            value = getattr(self, hook)
            if value is not None and not callable(value):
                raise TypeError(f"{where}: {hook}: expected a callable, found {value!r}")
        if self.state_dict_adapter is not None and not isinstance(self.state_dict_adapter, type):
            raise TypeError(
                f"{where}: state_dict_adapter: expected a class (as upstream), found "
                f"{self.state_dict_adapter!r}"
            )
        if not isinstance(self.flavors, Mapping):
            raise TypeError(f"{where}: flavors: expected a mapping, found {self.flavors!r}")
        for flavor, config in self.flavors.items():
            if not isinstance(config, BaseModel.Config):
                raise TypeError(
                    f"{where}: flavor {flavor!r}: expected a BaseModel.Config, "
                    f"found {type(config).__name__}"
                )
        if self.converter is not None and not isinstance(self.converter, ModelConfigConverter):
            raise TypeError(
                f"{where}: converter: expected a ModelConfigConverter, found {self.converter!r}"
            )
        if self.pipeline_split is not None:
            from hyper_parallel.dmodule.pipeline.split import PipelineSplit

            if not isinstance(self.pipeline_split, PipelineSplit):
                raise TypeError(
                    f"{where}: pipeline_split: expected a PipelineSplit, found "
                    f"{self.pipeline_split!r}"
                )

    def config(self, flavor: str | None = None) -> BaseModel.Config:
        """A copy of ``model`` (no ``flavor``) or of the config of ``flavor`` (unknown: did-you-mean).

        Example::

            >>> spec.config("debug").build()  # doctest: +SKIP
        """
        if flavor is None:
            if self.model is None:
                raise LookupError(
                    f"model {self.name!r} is built by build_model_fn and has no model config; "
                    f"name a flavor{_did_you_mean('', list(self.flavors))}"
                )
            return self.model.replace()
        found = self.flavors.get(flavor)
        if found is None:
            raise LookupError(
                f"model {self.name!r} has no flavor {flavor!r}"
                + _did_you_mean(flavor, list(self.flavors))
            )
        return found.replace()


#: The built-in models: name -> the module that registers it when imported. The default
#: registry imports it the first time the name is asked for, so ``get_spec("llama-ref")``
#: needs no import of the model first (and hp-dmodule's root imports no model).
BUILTIN_MODELS: Mapping[str, str] = {
    "llama-ref": "hyper_parallel.dmodule.models.llama",
    "qwen3-ref": "hyper_parallel.dmodule.models.qwen3",
}


class ModelRegistry:
    """Model specs by name; the module-level functions use one default registry.

    ``builtins`` (name -> module) are models registered by importing their module, which
    the registry does the first time one is asked for (:data:`BUILTIN_MODELS` in the
    default registry).

    Example::

        >>> registry = ModelRegistry()
        >>> registry.register(ModelSpec(name="tiny", model=BaseModel.Config()))
        >>> registry.get("tiny").name
        'tiny'
    """

    def __init__(self, builtins: Mapping[str, str] | None = None) -> None:
        self._specs: dict[str, ModelSpec] = {}
        self._builtins = dict(builtins or {})

    def _load_builtin(self, name: str) -> None:
        """Import the module of built-in model ``name`` (it registers itself), once."""
        module = self._builtins.pop(name, None)
        if module is not None and name not in self._specs:
            importlib.import_module(module)

    def _load_builtins(self) -> None:
        for name in list(self._builtins):
            self._load_builtin(name)

    def register(self, spec: ModelSpec, *, name: str | None = None, replace: bool = False) -> None:
        """Add ``spec`` under ``name`` (default ``spec.name``); a taken name raises unless ``replace``."""
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"register_spec: expected a ModelSpec, found {type(spec).__name__}")
        key = spec.name if name is None else name
        if not isinstance(key, str) or not key:
            raise ValueError(f"register_spec: expected a non-empty str name, found {key!r}")
        existing = self._specs.get(key)
        if existing is not None and not replace and existing is not spec:
            raise ValueError(
                f"register_spec: a model named {key!r} is already registered "
                f"(flavors {sorted(existing.flavors)}); pick another name or pass replace=True"
            )
        self._specs[key] = spec

    def get(self, name: str) -> ModelSpec:
        """The spec registered as ``name`` (unknown names raise :class:`UnknownModelError`)."""
        if name not in self._specs:
            self._load_builtin(name)
        found = self._specs.get(name)
        if found is None:
            raise UnknownModelError(
                f"get_spec: no model named {name!r}" + _did_you_mean(name, self.names())
            )
        return found

    def unregister(self, name: str) -> None:
        """Remove the spec registered as ``name`` (unknown names raise)."""
        self.get(name)
        del self._specs[name]

    def names(self) -> list[str]:
        """Registered names (built-in ones included), sorted."""
        return sorted({*self._specs, *self._builtins})

    def find(self, config: object) -> ModelSpec | None:
        """The spec whose ``model`` or flavors are of ``config``'s class (None when none is)."""
        self._load_builtins()
        for spec in self._specs.values():
            configs = [*spec.flavors.values(), *([spec.model] if spec.model is not None else [])]
            if any(type(c) is type(config) for c in configs):
                return spec
        return None


_default_registry = ModelRegistry(BUILTIN_MODELS)


def register_spec(
    name_or_spec: str | ModelSpec, spec: ModelSpec | None = None, *, replace: bool = False
) -> None:
    """Register a spec in the default registry: ``register_spec(name, spec)`` as upstream, or ``register_spec(spec)``.

    Example::

        >>> register_spec("doc-tiny", ModelSpec(name="doc-tiny", model=BaseModel.Config()))
        >>> get_spec("doc-tiny").config()
        BaseModel.Config(param_init=None, sharding_config=None)
        >>> unregister_spec("doc-tiny")
    """
    if isinstance(name_or_spec, ModelSpec):
        if spec is not None:
            raise TypeError("register_spec: expected (name, spec) or (spec), found two specs")
        _default_registry.register(name_or_spec, replace=replace)
        return
    if spec is None:
        raise TypeError(
            f"register_spec({name_or_spec!r}): expected a ModelSpec as the second argument"
        )
    _default_registry.register(spec, name=name_or_spec, replace=replace)


def get_spec(name: str) -> ModelSpec:
    """The spec registered as ``name`` in the default registry.

    Example::

        >>> get_spec("llama-ref").config("8B").n_layers  # built-in: no import needed
        32
        >>> get_spec("no-such-model")  # doctest: +SKIP
        LookupError: get_spec: no model named 'no-such-model' Known: ['llama-ref', 'qwen3-ref']
    """
    return _default_registry.get(name)


def spec_for_config(config: object) -> ModelSpec | None:
    """The registered spec whose model config or flavors are of ``config``'s class, if any.

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> spec_for_config(Llama.Config()).name
        'llama-ref'
    """
    return _default_registry.find(config)


def unregister_spec(name: str) -> None:
    """Remove ``name`` from the default registry.

    Example::

        >>> unregister_spec("doc-tiny")  # doctest: +SKIP
    """
    _default_registry.unregister(name)

"""BaseModel: the protocol a trainer relies on, and converters from external model configs.

Modelled on TorchTitan's model protocol: a model is built from its ``Config``; the
config can be updated from a trainer's (job) config and reports the parameter count
and training FLOPs per token; the model initialises its weights with ``init_weights``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.module import Module, _missing_initializers

__all__ = ["BaseModel", "ModelConfigConverter", "ModuleProtocolError"]

_C = TypeVar("_C", bound="BaseModel.Config")


class BaseModel(Module):
    """A whole model: a :class:`Module` with the protocol trainers use.

    - ``init_weights(buffer_device=None)``: initialise every parameter and buffer
      (:meth:`Module.init_states`; works on meta-built, parallelized, ``to_empty`` models).
    - ``verify_module_protocol(strict=False)``: raise :class:`ModuleProtocolError` listing
      plain ``torch.nn`` submodules (and with ``strict``, what else a trainer trips on).
    - ``Config.update_from_config(job_config)``: a copy taking fields from a trainer config.
    - ``Config.get_nparams_and_flops(model, seq_len)``: parameter count and FLOPs per token.

    Example::

        >>> from dataclasses import dataclass
        >>> class Tiny(BaseModel):
        ...     @dataclass(kw_only=True, slots=True)
        ...     class Config(BaseModel.Config):
        ...         dim: int = 4
        ...         param_init = {"weight": torch.nn.init.ones_}
        ...     def __init__(self, config: Config) -> None:
        ...         super().__init__()
        ...         self.config = config
        ...         self.weight = torch.nn.Parameter(torch.empty(config.dim, config.dim))
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return x @ self.weight
        >>> model = Tiny.Config().update_from_config({"model": {"dim": 8}}).build()
        >>> model.verify_module_protocol(); model.init_weights()
        >>> model.config.get_nparams_and_flops(model, seq_len=16)
        (64, 384.0)
    """

    #: Set ``is_embedding = True`` on a layer class whose parameters are lookup tables
    #: (excluded from the 6-FLOPs-per-parameter estimate, like ``nn.Embedding``).
    is_embedding: ClassVar[bool] = False

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """Config of a whole model.

        Example::

            >>> BaseModel.Config().update_from_config({}) == BaseModel.Config()
            True
        """

        def update_from_config(self: _C, job_config: Mapping[str, Any]) -> _C:
            """A copy whose fields named in ``job_config["model"]`` take those values.

            Unknown names raise :class:`~hyper_parallel.config.ConfigError` with a
            did-you-mean. A model whose fields derive from other sections (say
            ``max_seq_len`` from ``job_config["training"]["seq_len"]``) overrides this
            and calls ``BaseModel.Config.update_from_config(self, job_config)`` first.

            Example::

                >>> BaseModel.Config().update_from_config({"training": {"steps": 1}})
                BaseModel.Config(param_init=None, sharding_config=None)
            """
            section = job_config.get("model")
            if section is None:
                return self.replace()
            if not isinstance(section, Mapping):
                raise ConfigError(
                    f"expected a mapping of model fields, found {type(section).__name__}",
                    path="model",
                )
            return self.replace(**dict(section))

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, float]:
            """``(parameters, training FLOPs per token)`` of ``model``.

            Parameters are counted once each, by global size (a DTensor counts its whole
            tensor). FLOPs: 6 per non-embedding parameter per token (2 forward, 4
            backward). A transformer adds attention's ``seq_len``-dependent term
            (``12 * layers * heads * head_dim * seq_len``) by overriding this.

            Example::

                >>> BaseModel.Config().get_nparams_and_flops(torch.nn.Linear(4, 2), 8)
                (10, 60.0)
            """
            if seq_len < 1:
                raise ValueError(f"get_nparams_and_flops: seq_len must be >= 1, found {seq_len}")
            nparams = sum(p.numel() for p in model.parameters())
            embedding = {
                id(p)
                for m in model.modules()
                if isinstance(m, torch.nn.Embedding) or getattr(type(m), "is_embedding", False)
                for p in m.parameters(recurse=False)
            }
            nembedding = sum(p.numel() for p in model.parameters() if id(p) in embedding)
            return nparams, 6.0 * (nparams - nembedding)

    def init_weights(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer (TorchTitan's name for :meth:`init_states`).

        Example::

            >>> model.init_weights(buffer_device=torch.device("cpu"))  # doctest: +SKIP
        """
        self.init_states(buffer_device=buffer_device)

    def verify_module_protocol(self, *, strict: bool = False) -> None:
        """Raise :class:`ModuleProtocolError` listing every submodule that is not a :class:`Module`.

        As upstream: a plain ``torch.nn`` child (``nn.Linear``, ``nn.ModuleList``) is
        flagged with its path; wrap it with :meth:`Module.from_nn_module` or use the
        ``ModuleList``/``ModuleDict``/``Sequential`` of ``hyper_parallel.dmodule``.
        ``strict=True`` (an addition here) also checks that the class declares its own
        ``Config`` (so ``Config().build()`` makes this class), overrides ``forward``, and that
        every parameter has an initializer (so ``init_weights`` works on a meta-built model).

        Example::

            >>> model.verify_module_protocol(strict=True)  # doctest: +SKIP
        """
        cls = type(self)
        base = getattr(cls, "_hp_parallel_base", None) or cls
        problems = [
            f"{path!r} ({type(sub).__name__}) is a plain {type(sub).__module__}."
            f"{type(sub).__qualname__}, not a hyper_parallel.dmodule.Module; wrap its class "
            "with Module.from_nn_module (containers: hyper_parallel.dmodule.ModuleList, "
            "ModuleDict, Sequential)"
            for path, sub in self.named_modules()
            if not isinstance(sub, Module)
        ]
        if strict:
            if getattr(base.Config, "_hp_owner", None) is not base:
                problems.append(
                    f"{base.__name__} declares no Config of its own; declare "
                    f"`class Config({base.__mro__[1].__name__}.Config)` inside it so that "
                    f"Config().build() makes a {base.__name__}"
                )
            if base.forward is torch.nn.Module.forward:
                problems.append(f"{base.__name__} does not define forward()")
            problems += _missing_initializers(self, "")
        if problems:
            raise ModuleProtocolError(
                f"{base.__name__}.verify_module_protocol: {len(problems)} problem(s):\n  "
                + "\n  ".join(problems)
            )


class ModuleProtocolError(RuntimeError, TypeError):
    """A model breaks the :class:`BaseModel` protocol.

    A ``RuntimeError`` as upstream raises, and the ``TypeError`` raised here before.

    Example::

        >>> issubclass(ModuleProtocolError, RuntimeError), issubclass(ModuleProtocolError, TypeError)
        (True, True)
    """


class ModelConfigConverter(abc.ABC, Generic[_C]):
    """Converts an external model config (e.g. a Hugging Face ``config.json``) to a Config and back.

    Subclasses implement both directions; ``round_trip`` checks they agree.

    Example::

        >>> class TinyConverter(ModelConfigConverter["Tiny.Config"]):  # doctest: +SKIP
        ...     def to_config(self, external):
        ...         return Tiny.Config(dim=external["hidden_size"])
        ...     def from_config(self, config):
        ...         return {"hidden_size": config.dim}
    """

    @abc.abstractmethod
    def to_config(self, external: Mapping[str, Any]) -> _C:
        """The Config described by ``external`` (raise ``ConfigError`` naming a bad key)."""

    @abc.abstractmethod
    def from_config(self, config: _C) -> dict[str, Any]:
        """The external config describing ``config``."""

    def round_trip(self, external: Mapping[str, Any]) -> dict[str, Any]:
        """``from_config(to_config(external))``: the keys this converter understands.

        Example::

            >>> TinyConverter().round_trip({"hidden_size": 8})  # doctest: +SKIP
            {'hidden_size': 8}
        """
        return self.from_config(self.to_config(external))

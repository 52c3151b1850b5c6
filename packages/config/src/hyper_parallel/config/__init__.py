"""Typed, nested, declarative configs (stdlib only).

Example::

    >>> from dataclasses import dataclass
    >>> from hyper_parallel.config import Configurable
    >>> class Linear(Configurable):
    ...     @dataclass(kw_only=True, slots=True)
    ...     class Config(Configurable.Config):
    ...         dim: int = 8
    ...     def __init__(self, *, config: Config) -> None:
    ...         self.config = config
    >>> Linear.Config().apply_overrides(["dim=16"]).build().config.dim
    16
"""

from hyper_parallel.config._check import check_fields
from hyper_parallel.config.cli import load_config, parse_cli_overrides
from hyper_parallel.config.configurable import (
    Configurable,
    TraverseKey,
    TraverseParent,
    enforce_module_config_slots,
)
from hyper_parallel.config.data import dataclass_from_dict, dataclass_to_dict
from hyper_parallel.config.errors import ConfigError, ConfigTypeError, UnboundConfigError
from hyper_parallel.config.leaf_codec import LeafCodec

__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "Configurable",
    "LeafCodec",
    "TraverseKey",
    "TraverseParent",
    "UnboundConfigError",
    "check_fields",
    "dataclass_from_dict",
    "dataclass_to_dict",
    "enforce_module_config_slots",
    "load_config",
    "parse_cli_overrides",
]

"""Small checks shared by the layers' and models' ``Config.validate``."""

from __future__ import annotations

from hyper_parallel.config import ConfigError

__all__ = ["require_positive"]


def require_positive(config: object, name: str) -> None:
    """Raise ``ConfigError(path=name)`` unless field ``name`` of ``config`` is an int >= 1.

    Example::

        >>> from types import SimpleNamespace
        >>> require_positive(SimpleNamespace(dim=0), "dim")
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: dim: expected an int >= 1, found 0
    """
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"expected an int >= 1, found {value!r}", path=name)

"""Small checks shared by the layers' and models' ``Config.validate``."""

from __future__ import annotations

from hyper_parallel.config import ConfigError

__all__ = ["require_positive", "require_positive_float"]


def require_positive(config: object, *names: str) -> None:
    """Raise ``ConfigError(path=name)`` unless each field ``name`` of ``config`` is an int >= 1.

    Example::

        >>> from types import SimpleNamespace
        >>> require_positive(SimpleNamespace(dim=0), "dim")
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: dim: expected an int >= 1, found 0
    """
    for name in names:
        value = getattr(config, name)
        if value is None and name.startswith("n_kv"):
            continue  # optional head counts: None means "the same as n_heads"
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"expected an int >= 1, found {value!r}", path=name)


def require_positive_float(config: object, *names: str) -> None:
    """Raise ``ConfigError(path=name)`` unless each field ``name`` is a finite number > 0.

    Example::

        >>> from types import SimpleNamespace
        >>> require_positive_float(SimpleNamespace(eps=-1.0), "eps")
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: eps: expected a finite float > 0, found -1.0
    """
    for name in names:
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
            raise ConfigError(f"expected a finite float > 0, found {value!r}", path=name)

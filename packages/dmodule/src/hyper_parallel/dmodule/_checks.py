"""Small checks shared by the layers' and models' ``Config.validate``."""

from __future__ import annotations

from typing import Any

from hyper_parallel.config import ConfigError

__all__ = ["check_model_input", "require_positive", "require_positive_float"]


def check_model_input(tokens: Any, *, where: str, name: str = "tokens") -> None:
    """Raise a ``ValueError`` unless ``tokens`` is a tensor ``[batch, seq, ...]`` with at least
    one row and one position (an empty batch otherwise fails deep in attention).

    Example::

        >>> import torch
        >>> check_model_input(torch.zeros(0, 8, dtype=torch.long), where="Llama.forward")
        Traceback (most recent call last):
        ...
        ValueError: Llama.forward: expected tokens of shape [batch, seq] with batch >= 1 and seq >= 1, found shape [0, 8]
    """
    shape = getattr(tokens, "shape", None)
    if shape is None:
        raise TypeError(f"{where}: expected {name} as a tensor, found {type(tokens).__name__}")
    if len(shape) < 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(
            f"{where}: expected {name} of shape [batch, seq] with batch >= 1 and seq >= 1, "
            f"found shape {list(shape)}"
        )


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

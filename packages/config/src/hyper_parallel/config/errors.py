"""ConfigError: the one exception of hp-config, saying where, what was expected and what was found."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config value, name or file that does not fit its declaration.

    ``path`` is the dotted location in the config tree (``"layers.0.dim"``; ``""`` is
    the root) or ``None`` when the error concerns no single value.

    Example::

        >>> str(ConfigError("expected int, found str '3'", path="layers.0.dim"))
        "layers.0.dim: expected int, found str '3'"
    """

    path: str | None

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        self.message = message
        where = "" if path is None else f"{path or '<root>'}: "
        super().__init__(f"{where}{message}")


def join_path(path: str, key: object) -> str:
    """Dotted path of ``key`` below ``path`` (the traverse format: ``layers.0.dim``)."""
    return f"{path}.{key}" if path else str(key)


def describe(value: object) -> str:
    """Short ``type repr`` of a found value for error messages."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`` did you mean 'x'?`` for the closest valid name, plus the list of valid names."""
    valid = sorted(options)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(valid) if valid else "(none)"
    return f"{hint} Valid names: {listing}"

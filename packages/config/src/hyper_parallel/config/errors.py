"""ConfigError: the one exception of hp-config, saying where, what was expected and what was found."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "ConfigTypeError", "UnboundConfigError"]


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


class ConfigTypeError(ConfigError, TypeError):
    """A value of the wrong type given to a Config (constructor, ``replace``, ``from_dict``).

    Both a :class:`ConfigError` and a ``TypeError``, so callers catching either work.

    Example::

        >>> isinstance(ConfigTypeError("expected int, found str '3'", path="dim"), TypeError)
        True
    """


class UnboundConfigError(ConfigError, NotImplementedError):
    """``build()`` on a Config that is bound to no Configurable.

    Both a :class:`ConfigError` and the ``NotImplementedError`` upstream hyper-parallel raises.

    Example::

        >>> isinstance(UnboundConfigError("no owner"), NotImplementedError)
        True
    """


def union_error(errors: list[ConfigError], path: str, fallback: ConfigError) -> ConfigError:
    """The error to raise when no member of a union at ``path`` fitted.

    The members that got past the first level (an error deeper than ``path``) know better
    than "expected X | Y" -- if they agree where it went wrong; else ``fallback``.

    Example::

        >>> deep = ConfigError("expected int, found str 'x'", path="a.b")
        >>> str(union_error([deep], "a", ConfigError("expected dict | None", path="a")))
        "a.b: expected int, found str 'x'"
    """
    deeper = [e for e in errors if e.path != path]
    if deeper and len({e.path for e in deeper}) == 1:
        return deeper[0]
    return fallback


def relocate(error: ConfigError, prefix: str) -> ConfigError:
    """``error`` with its path placed below ``prefix`` (same class, same message).

    Example::

        >>> str(relocate(ConfigError("expected >= 1, found 0", path="n_heads"), "model"))
        'model.n_heads: expected >= 1, found 0'
    """
    if not prefix:
        return error
    path = prefix if not error.path else join_path(prefix, error.path)
    moved = type(error).__new__(type(error))
    ConfigError.__init__(moved, error.message, path=path)
    return moved


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

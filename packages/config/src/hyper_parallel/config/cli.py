"""Command lines and files: parse_cli_overrides for ``--a.b=value``, load_config for JSON/TOML."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from hyper_parallel.config._annotations import init_fields
from hyper_parallel.config.configurable import Configurable
from hyper_parallel.config.errors import ConfigError

__all__ = ["load_config", "parse_cli_overrides"]

_C = TypeVar("_C", bound=Configurable.Config)


def parse_cli_overrides(
    argv: Sequence[str], config_cls: type[Configurable.Config] | None = None
) -> tuple[list[str], list[str]]:
    """Split ``argv`` into ``"a.b=value"`` overrides (from ``--a.b=value`` / ``--a.b value``) and the rest.

    With ``config_cls``, only options whose first path segment names one of its fields are
    taken (others, e.g. ``--help``, stay in ``rest`` for argparse), and such an option without
    a value is an error. Without it, every ``--key=value`` is taken, and ``--key value`` when
    the next argument does not start with ``--``. Everything from ``--`` on stays in ``rest``.

    Example::

        >>> parse_cli_overrides(["--optim.lr=0.1", "--layers.0.dim", "32", "train.py"])
        (['optim.lr=0.1', 'layers.0.dim=32'], ['train.py'])
    """
    names = None if config_cls is None else set(init_fields(config_cls))
    overrides: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            rest.extend(argv[index:])
            break
        key, sep, value = arg[2:].partition("=")
        is_override = (
            arg.startswith("--")
            and bool(key)
            and not key.startswith("-")
            and (names is None or key.split(".")[0] in names)
        )
        if is_override and sep:
            overrides.append(f"{key}={value}")
            index += 1
            continue
        if is_override and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            overrides.append(f"{key}={argv[index + 1]}")
            index += 2
            continue
        if is_override and names is not None:
            raise ConfigError(
                f"--{key}: expected a value ('--{key}=VALUE' or '--{key} VALUE'), found none",
                path=key,
            )
        rest.append(arg)
        index += 1
    return overrides, rest


def load_config(
    path: str | Path,
    config_cls: type[_C],
    overrides: Iterable[str] = (),
    *,
    allow_imports: Iterable[str] | None = None,
) -> _C:
    """Load a ``.json`` or ``.toml`` file as ``config_cls`` (then apply ``overrides``).

    ``allow_imports``: when given, callables and ``_type_`` tags in the file and the
    overrides resolve only from these modules (see ``Config.from_dict``).

    Example::

        >>> import tempfile, pathlib
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "empty.json"
        >>> _ = file.write_text("{}")
        >>> load_config(file, Configurable.Config)
        Configurable.Config()
    """
    file = Path(path)
    suffix = file.suffix.lower()
    try:
        if suffix == ".json":
            data: Any = json.loads(file.read_text(encoding="utf-8"))
        elif suffix == ".toml":
            data = _toml().loads(file.read_text(encoding="utf-8"))
        else:
            raise ConfigError(f"{file}: expected a .json or .toml file, found suffix {suffix!r}")
    except OSError as err:
        raise ConfigError(f"{file}: cannot read: {err}") from err
    except ValueError as err:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{file}: expected valid {suffix[1:].upper()}, found: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top, found {type(data).__name__}")
    try:
        allowed = None if allow_imports is None else tuple(allow_imports)
        config = config_cls.from_dict(data, allow_imports=allowed)
        return config.apply_overrides(overrides, allow_imports=allowed) if overrides else config
    except ConfigError as err:
        located = ConfigError(f"{file}: {err}")
        located.path = err.path  # keep the tree path for callers; the file leads the message
        raise located from err


def _toml() -> ModuleType:
    for name in ("tomllib", "tomli"):  # tomllib is stdlib from Python 3.11; tomli backports it
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ConfigError(
        "reading TOML needs Python >= 3.11 (tomllib) or the 'tomli' package installed"
    )

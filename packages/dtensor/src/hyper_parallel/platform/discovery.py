"""Find the installed platform adapter through the ``hyper_parallel.platforms`` entry points."""

from __future__ import annotations

import functools
import os
from importlib.metadata import EntryPoint, entry_points

from hyper_parallel.platform.protocol import Platform

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV_VAR",
    "PlatformNotFoundError",
    "get_platform",
    "installed_platforms",
    "protocol_members",
]

ENTRY_POINT_GROUP = "hyper_parallel.platforms"
PLATFORM_ENV_VAR = "HYPER_PARALLEL_PLATFORM"
_DEFAULT_PACKAGE = "hp-platform-torch"


class PlatformNotFoundError(RuntimeError):
    """No usable platform adapter: none installed, or not the one asked for."""


def installed_platforms() -> dict[str, EntryPoint]:
    """The installed adapters, by entry-point name, sorted by name.

    Example::

        >>> sorted(installed_platforms())
        ['torch']
    """
    found = entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep for ep in sorted(found, key=lambda ep: ep.name)}


@functools.cache
def get_platform() -> Platform:
    """The active platform adapter, loaded once and cached.

    With one adapter installed it is used; with several, ``HYPER_PARALLEL_PLATFORM``
    names the one to use. The choice is cached for the life of the process; tests
    that change the environment call ``get_platform.cache_clear()`` to choose again.

    Example::

        >>> get_platform().name
        'torch'
    """
    available = installed_platforms()
    if not available:
        raise PlatformNotFoundError(
            f"no hyper-parallel platform adapter is installed (entry-point group "
            f"{ENTRY_POINT_GROUP!r} is empty); install one, e.g. `pip install {_DEFAULT_PACKAGE}`"
        )
    requested = os.environ.get(PLATFORM_ENV_VAR, "").strip()
    if requested:
        if requested not in available:
            raise PlatformNotFoundError(
                f"{PLATFORM_ENV_VAR}={requested!r} but the installed platform adapters are "
                f"{tuple(available)}; unset it or pick one of those"
            )
        entry_point = available[requested]
    elif len(available) == 1:
        (entry_point,) = available.values()
    else:
        raise PlatformNotFoundError(
            f"several platform adapters are installed {tuple(available)}; set "
            f"{PLATFORM_ENV_VAR} to one of them"
        )
    return _load(entry_point)


def protocol_members() -> tuple[str, ...]:
    """The names a ``Platform`` must provide, sorted.

    Example::

        >>> "all_gather" in protocol_members()
        True
    """
    methods = (name for name, value in vars(Platform).items() if callable(value))
    names = {*Platform.__annotations__, *methods}
    return tuple(sorted(name for name in names if not name.startswith("_")))


def _load(entry_point: EntryPoint) -> Platform:
    """Instantiate the adapter an entry point names and check it implements ``Platform``."""
    where = f"entry point {entry_point.name!r} ({entry_point.value})"
    try:
        factory = entry_point.load()
    except Exception as error:
        raise PlatformNotFoundError(f"cannot load platform adapter {where}: {error}") from error
    platform = factory() if callable(factory) else factory
    if not isinstance(platform, Platform):
        missing = [name for name in protocol_members() if not hasattr(platform, name)]
        raise PlatformNotFoundError(
            f"platform adapter {where} does not implement the Platform protocol; "
            f"missing members: {missing}"
        )
    return platform

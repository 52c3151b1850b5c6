"""The platform seam: the small protocol through which hyper-parallel reaches a framework.

``get_platform()`` returns the installed adapter (``hp-platform-torch`` provides
``torch``); dtensor and dmodule use nothing of the framework but what
:class:`Platform` declares and the framework's own tensor API.

Example::

    >>> from hyper_parallel.platform import get_platform
    >>> get_platform().name
    'torch'
"""

from hyper_parallel.platform.discovery import (
    ENTRY_POINT_GROUP,
    PLATFORM_ENV_VAR,
    PlatformNotFoundError,
    get_platform,
    installed_platforms,
)
from hyper_parallel.platform.protocol import Platform, ReduceOpName

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV_VAR",
    "Platform",
    "PlatformNotFoundError",
    "ReduceOpName",
    "get_platform",
    "installed_platforms",
]

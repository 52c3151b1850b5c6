"""to_dict / from_dict for dataclasses that are not Configs (e.g. hp-dmodule's ShardingConfig)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from hyper_parallel.config._codec import Decoder, JSONValue, encode

__all__ = ["dataclass_from_dict", "dataclass_to_dict"]

_D = TypeVar("_D")


def dataclass_to_dict(obj: object) -> dict[str, JSONValue]:
    """JSON data for dataclass ``obj``, in the format of ``Config.to_dict``.

    Example::

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Point:
        ...     x: int = 0
        >>> dataclass_to_dict(Point(x=3))
        {'x': 3}
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"dataclass_to_dict: expected a dataclass instance, found {obj!r}")
    data = encode(obj, type(obj), "")
    assert isinstance(data, dict)
    return data


def dataclass_from_dict(cls: type[_D], data: Mapping[str, object]) -> _D:
    """An instance of dataclass ``cls`` from :func:`dataclass_to_dict` data (coerced by annotations).

    Example::

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Point:
        ...     x: int = 0
        >>> dataclass_from_dict(Point, {"x": 3})
        Point(x=3)
    """
    from hyper_parallel.config.configurable import Configurable

    decoded: Any = Decoder(Configurable.Config).decode_dataclass(data, cls, "")
    return decoded  # type: ignore[no-any-return]

"""LeafCodec: how a value type that is not JSON data is written by to_dict and read back.

A package that owns such a type (hp-dmodule for hp-dtensor's placements) attaches a codec
to its annotations with ``typing.Annotated``; hp-config itself knows no such type, keeps no
registry and imports nothing of that package.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LeafCodec", "leaf_codec"]


@dataclass(frozen=True)
class LeafCodec:
    """Encode/decode of one leaf type, used as ``Annotated[T, LeafCodec(...)]`` metadata.

    - ``type``: the class the values are instances of (checked by the Config constructor).
    - ``encode(value)``: JSON data for the value (what ``to_dict`` writes).
    - ``decode(data)``: the value for JSON data, and for the text of an override (an
      override's text is first read as JSON when it is valid JSON, else passed as the
      string). Raises ``ValueError`` or ``TypeError`` for data it does not accept; hp-config
      adds the path.
    - ``expected``: what the data looks like, for error messages.

    Example::

        >>> from fractions import Fraction
        >>> FRACTION = LeafCodec(Fraction, str, Fraction, "a fraction such as '1/3'")
        >>> FRACTION.decode(FRACTION.encode(Fraction(1, 3)))
        Fraction(1, 3)
    """

    type: type
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    expected: str


def leaf_codec(annotation: object) -> LeafCodec | None:
    """The :class:`LeafCodec` in ``Annotated[T, ...]`` metadata, or None.

    Example::

        >>> leaf_codec(int) is None
        True
    """
    while typing.get_origin(annotation) is typing.Annotated:
        for meta in getattr(annotation, "__metadata__", ()):
            if isinstance(meta, LeafCodec):
                return meta
        annotation = typing.get_args(annotation)[0]
    return None

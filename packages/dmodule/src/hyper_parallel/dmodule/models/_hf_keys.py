"""Key maps between the reference models' FQNs and Hugging Face's, shared by their adapters."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["KeyMap", "read_hf_config"]


def _compile(pattern: str) -> re.Pattern[str]:
    escaped = re.escape(pattern)
    for field in ("i", "e"):
        escaped = escaped.replace(re.escape("{" + field + "}"), rf"(?P<{field}>\d+)")
    return re.compile(escaped + "$")


def _fill(target: str, match: re.Match[str]) -> str:
    for field, value in match.groupdict().items():
        target = target.replace("{" + field + "}", value)
    return target


class KeyMap:
    """Renames keys both ways from ``(ours, theirs)`` patterns; ``{i}`` is a layer index.

    Example::

        >>> keys = KeyMap([("layers.{i}.norm.weight", "model.layers.{i}.ln.weight")], "Toy")
        >>> keys.to_hf("layers.3.norm.weight")
        'model.layers.3.ln.weight'
        >>> keys.from_hf("model.layers.3.ln.weight")
        'layers.3.norm.weight'
    """

    def __init__(self, pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...], model: str):
        self.model = model
        self._to_hf = [(_compile(ours), theirs) for ours, theirs in pairs]
        self._from_hf = [(_compile(theirs), ours) for ours, theirs in pairs]

    def to_hf(self, key: str) -> str:
        """The Hugging Face key of our ``key`` (a ``KeyError`` naming it when there is none)."""
        return self._rename(key, self._to_hf, "to_hf")

    def from_hf(self, key: str) -> str:
        """Our key of the Hugging Face ``key`` (a ``KeyError`` naming it when there is none)."""
        return self._rename(key, self._from_hf, "from_hf")

    def _rename(self, key: str, table: list[tuple[re.Pattern[str], str]], where: str) -> str:
        for pattern, target in table:
            match = pattern.match(key)
            if match:
                return _fill(target, match)
        raise KeyError(
            f"{self.model}StateDictAdapter.{where}: no Hugging Face {self.model} counterpart "
            f"for key {key!r}"
        )


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a transformers checkpoint directory (or the file itself).

    Example::

        >>> read_hf_config("path/to/Qwen3-0.6B")["model_type"]  # doctest: +SKIP
        'qwen3'
    """
    path = Path(directory)
    path = path / "config.json" if path.is_dir() else path
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data

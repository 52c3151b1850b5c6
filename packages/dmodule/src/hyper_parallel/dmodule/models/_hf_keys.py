"""Key maps between the reference models' FQNs and Hugging Face's, shared by their adapters."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["HFFields", "KeyMap", "read_hf_config", "tie_problems"]


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

    A missing file, invalid JSON or JSON that is not an object raise a ``ValueError``
    naming the file (and where in it the JSON broke).

    Example::

        >>> read_hf_config("path/to/Qwen3-0.6B")["model_type"]  # doctest: +SKIP
        'qwen3'
    """
    path = _config_path(directory)
    if not path.is_file():
        raise FileNotFoundError(f"from_hf: no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"from_hf: {path} is not valid JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(f"from_hf: {path} is not UTF-8 text ({error.reason})") from None
    if not isinstance(data, dict):
        raise ValueError(f"from_hf: {path}: expected a JSON object, found {type(data).__name__}")
    return data


def _config_path(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    return path / "config.json" if path.is_dir() else path


_MISSING = object()


class HFFields:
    """Typed reads of a ``config.json``'s fields; a missing or mistyped one names file and field.

    Example::

        >>> HFFields({"hidden_size": 8}, "config.json").int("hidden_size")
        8
        >>> HFFields({}, "config.json").int("hidden_size")
        Traceback (most recent call last):
        ...
        ValueError: from_hf: config.json: missing field 'hidden_size' (an int)
    """

    def __init__(self, data: dict[str, Any], path: str) -> None:
        self.data, self.path = data, path

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> HFFields:
        """The fields of ``directory``'s ``config.json`` (:func:`read_hf_config`)."""
        return cls(read_hf_config(directory), str(_config_path(directory)))

    def get(self, key: str, default: Any = None) -> Any:
        """Field ``key`` as it is (``default`` when absent)."""
        return self.data.get(key, default)

    def _get(self, key: str, default: object, kind: str) -> Any:
        """Field ``key``; absent or null: ``default`` (none given: an error naming the field)."""
        value = self.data.get(key)
        if value is None:
            value = default
        if value is _MISSING:
            raise ValueError(f"from_hf: {self.path}: missing field {key!r} ({kind})")
        return value

    def opt_int(self, key: str) -> int | None:
        """Field ``key``, an int, or None when it is absent or null.

        Example::

            >>> HFFields({"head_dim": None}, "config.json").opt_int("head_dim") is None
            True
        """
        return None if self.data.get(key) is None else self.int(key)

    def _bad(self, key: str, kind: str, value: object) -> ValueError:
        return ValueError(f"from_hf: {self.path}: field {key!r}: expected {kind}, found {value!r}")

    def int(self, key: str, default: object = _MISSING) -> int:
        """Field ``key``, an int (JSON numbers without a fraction)."""
        value = self._get(key, default, "an int")
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise self._bad(key, "an int", value)
        return value

    def float(self, key: str, default: object = _MISSING) -> float:
        """Field ``key``, a number."""
        value = self._get(key, default, "a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, "a number", value)
        return float(value)

    def bool(self, key: str, default: object = _MISSING) -> bool:
        """Field ``key``, true or false."""
        value = self._get(key, default, "true or false")
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value


def tie_problems(hf_config: dict[str, Any], tied: bool) -> list[str]:
    """A model with tied embeddings cannot take a checkpoint whose output has its own weights.

    (The other way works: an untied model reads the tied checkpoint's embedding twice.)

    Example::

        >>> tie_problems({"tie_word_embeddings": False}, True)
        ['tie_word_embeddings: checkpoint False (its own lm_head.weight), model True']
    """
    theirs = hf_config.get("tie_word_embeddings", False)
    if tied and theirs is False:
        return [f"tie_word_embeddings: checkpoint {theirs} (its own lm_head.weight), model True"]
    return []

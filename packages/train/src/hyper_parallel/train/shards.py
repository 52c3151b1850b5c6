"""Prepared data: token shards, document starts and ``index.json``, as ``hp-train prepare`` writes them.

A prepared directory holds:

- ``tokens-NNNNN.bin``: the token stream in order, each document followed by EOS, as raw
  little-endian ``uint16`` (vocabularies of at most 65,536 ids) or ``uint32``;
- ``documents.bin``: the first token of every document, little-endian ``int64``;
- ``index.json``: the tokenizer's identity, the dtype, the document and token counts and
  every file with its size (written last: a directory without it is not prepared data).

Every file reads with ``numpy.memmap(path, dtype, mode="r")``. :class:`ShardedTokens` maps
them for a job: nothing is read until a sample is, so startup and memory do not grow
with the corpus, and every rank of a node shares the page cache.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "DOCUMENTS_FILE",
    "FORMAT",
    "INDEX_FILE",
    "PreparedIndex",
    "ShardedTokens",
    "is_prepared",
    "read_index",
    "token_dtype",
    "tokenizer_identity",
]

#: The name of a prepared directory's index.
INDEX_FILE = "index.json"
#: The document starts' file.
DOCUMENTS_FILE = "documents.bin"
#: ``index.json``'s ``format``.
FORMAT = "hp-train-tokens"


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id fits 16 bits, else ``"uint32"``.

    Example::

        >>> token_dtype(257), token_dtype(65_536), token_dtype(65_537)
        ('uint16', 'uint16', 'uint32')
    """
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_identity(path: str) -> dict[str, str]:
    """The tokenizer's identity for ``index.json``: ``bytes``, or its ``tokenizer.json``'s SHA-256.

    Example::

        >>> tokenizer_identity("")
        {'kind': 'bytes'}
    """
    if not path:
        return {"kind": "bytes"}
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer.path: expected a tokenizer.json, found no {file}")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    return {"kind": "tokenizer.json", "sha256": digest, "path": str(file)}


def describe_tokenizer(identity: dict[str, str]) -> str:
    """A tokenizer identity in words (errors)."""
    if identity.get("kind") == "bytes":
        return "the byte tokenizer (tokenizer.path = '')"
    return (
        f"tokenizer.json {identity.get('path', '?')!r} (sha256 {identity.get('sha256', '?')[:12]})"
    )


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a directory written by ``hp-train prepare`` (it has an ``index.json``)."""
    return bool(path) and (Path(path) / INDEX_FILE).is_file()


@dataclass(frozen=True)
class PreparedIndex:
    """A prepared directory's ``index.json``, read and checked against the files beside it."""

    root: Path
    data: dict[str, Any]
    #: SHA-256 of ``index.json``'s bytes: what a checkpoint records of the data
    identity: str

    @property
    def dtype(self) -> str:
        """``"uint16"`` or ``"uint32"``."""
        return str(self.data["dtype"])

    @property
    def tokens(self) -> int:
        """The number of tokens, EOS included."""
        return int(self.data["tokens"])

    @property
    def documents(self) -> int:
        """The number of documents."""
        return int(self.data["documents"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        """``{"name", "tokens", "bytes"}`` of each shard, in stream order."""
        return list(self.data["shards"])

    def check_tokenizer(self, path: str, *, key: str) -> None:
        """Refuse a job whose ``tokenizer.path`` is not the tokenizer these tokens were made with."""
        mine = tokenizer_identity(path)
        theirs = dict(self.data["tokenizer"])
        same = mine["kind"] == theirs.get("kind") and mine.get("sha256") == theirs.get("sha256")
        if not same:
            raise ValueError(
                f"{key} = {str(self.root)!r}: prepared with {describe_tokenizer(theirs)}, but the "
                f"job's tokenizer is {describe_tokenizer(mine)}: expected the same tokenizer "
                "(prepare the data again, or set tokenizer.path to the one it was made with)"
            )


def read_index(path: str | Path, *, key: str = "data.path") -> PreparedIndex:
    """The ``index.json`` of the prepared directory ``path``, its files' sizes checked.

    A missing or truncated shard is refused naming the file, its expected and found sizes.
    Reads nothing but ``index.json`` (the other files are only ``stat``-ed).

    Example::

        >>> read_index("/nonexistent")
        Traceback (most recent call last):
        ...
        FileNotFoundError: data.path = '/nonexistent': expected a directory prepared by hp-train prepare, found no /nonexistent/index.json
    """
    root = Path(path)
    file = root / INDEX_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{key} = {str(path)!r}: expected a directory prepared by hp-train prepare, found no {file}"
        )
    raw = file.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"{key}: {file}: expected JSON, found {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(
            f"{key}: {file}: expected format {FORMAT!r}, found "
            f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}"
        )
    index = PreparedIndex(root, data, hashlib.sha256(raw).hexdigest())
    itemsize = np.dtype(index.dtype).itemsize
    expected = [(DOCUMENTS_FILE, index.documents * 8)]
    expected += [(str(s["name"]), int(s["tokens"]) * itemsize) for s in index.shards]
    for name, size in expected:
        target = root / name
        found = target.stat().st_size if target.is_file() else None
        if found != size:
            raise ValueError(
                f"{key} = {str(path)!r}: {target}: expected {size:,} bytes (index.json), found "
                f"{'no file' if found is None else f'{found:,} bytes'}: the directory is damaged "
                "or incomplete (prepare it again)"
            )
    if sum(int(s["tokens"]) for s in index.shards) != index.tokens:
        raise ValueError(f"{key}: {file}: the shards' tokens do not add up to 'tokens'")
    return index


class ShardedTokens:
    """The token stream of a prepared directory, memory-mapped (a :class:`~.data.TokenSource`).

    Example::

        source = ShardedTokens(read_index("prepared/"))  # doctest: +SKIP
        tokens, documents = source.window(0, 65)
    """

    def __init__(self, index: PreparedIndex) -> None:
        self.index = index
        dtype = np.dtype(index.dtype).newbyteorder("<")
        self._shards: list[npt.NDArray[Any]] = [
            np.memmap(index.root / str(s["name"]), dtype=dtype, mode="r") for s in index.shards
        ]
        self._offsets = [0]
        for shard in self._shards:
            self._offsets.append(self._offsets[-1] + len(shard))
        self._starts: npt.NDArray[np.int64] = (
            np.memmap(index.root / DOCUMENTS_FILE, dtype=np.dtype("<i8"), mode="r")
            if index.documents
            else np.zeros(0, dtype=np.int64)
        )

    def __len__(self) -> int:
        return self._offsets[-1]

    def window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``start .. stop - 1`` (int64) and the number of each one's document."""
        stop = min(stop, len(self))
        parts = []
        shard = max(bisect.bisect_right(self._offsets, start) - 1, 0)
        position = start
        while position < stop and shard < len(self._shards):
            local = position - self._offsets[shard]
            take = min(stop, self._offsets[shard + 1]) - position
            if take > 0:
                parts.append(self._shards[shard][local : local + take])
                position += take
            shard += 1
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        positions = np.arange(start, max(stop, start), dtype=np.int64)
        documents = np.searchsorted(self._starts, positions, side="right") - 1
        return (
            torch.from_numpy(tokens.astype(np.int64)),
            torch.from_numpy(documents.astype(np.int64)),
        )

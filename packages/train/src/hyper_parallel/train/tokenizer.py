"""Tokenizers: bytes (ids 0-255, EOS 256) by default, or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["BYTE_EOS", "ByteTokenizer", "HFTokenizer", "Tokenizer", "build_tokenizer"]

#: The byte tokenizer's end-of-document id: one past the 256 byte values.
BYTE_EOS = 256


class Tokenizer(Protocol):
    """Text to ids; ``eos_id`` ends every document; ``vocab_size`` bounds the ids."""

    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text`` (int64, no EOS)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids; EOS is 256, so models need ``vocab_size >= 257``.

    Example::

        >>> ByteTokenizer().encode("hi").tolist()
        [104, 105]
    """

    eos_id = BYTE_EOS
    vocab_size = BYTE_EOS + 1

    def encode(self, text: str) -> torch.Tensor:
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through ``tokenizers`` (the ``tokenizers`` extra).

    EOS is the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` in its
    vocabulary, else one id past the vocabulary.

    Example::

        tokenizer = HFTokenizer("tokenizer.json")  # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"tokenizer.path = {str(path)!r} needs the 'tokenizers' package: "
                "pip install 'hp-train[tokenizers]'"
            ) from error
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.path: expected a tokenizer.json, found no {file}")
        self._tokenizer: Any = _Tokenizer.from_file(str(file))
        vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"):
            found = self._tokenizer.token_to_id(name)
            if found is not None:
                self.eos_id: int = int(found)
                self.vocab_size: int = vocab
                break
        else:
            self.eos_id, self.vocab_size = vocab, vocab + 1

    def encode(self, text: str) -> torch.Tensor:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return torch.tensor(ids, dtype=torch.long)


def build_tokenizer(path: str) -> Tokenizer:
    """The byte tokenizer for ``""``, else the Hugging Face tokenizer at ``path``.

    Example::

        >>> build_tokenizer("").vocab_size
        257
    """
    return ByteTokenizer() if not path else HFTokenizer(path)

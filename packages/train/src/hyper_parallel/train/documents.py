"""Documents: the text of files, directories, globs, JSONL and ``datasets`` directories, decoded and counted.

One document per text file, JSONL line (its ``data.field``) or dataset row. Text is read
with universal newlines (``\\r\\n`` and ``\\r`` become ``\\n``). Bytes the encoding cannot
decode become U+FFFD and are counted per file: a file where more than
:data:`MAX_UNDECODABLE_SHARE` of the characters could not be decoded is refused, naming it
and its share, unless the job opts in (``data.decode_errors = "replace"``) or names the
file's encoding (``data.encoding``). ``hp-train`` and ``hp-train prepare`` read through
the same functions, so both see the same documents.
"""

from __future__ import annotations

import codecs
import glob
import importlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

__all__ = [
    "MAX_UNDECODABLE_SHARE",
    "DecodeReport",
    "builtin_corpus",
    "decode",
    "documents_of_text",
    "find_files",
    "is_hf_dataset",
    "read_documents",
]

#: The built-in corpus's size: enough text for a small model, tokenized in well under a second.
BUILTIN_CORPUS_BYTES = 2_000_000

#: The largest share of a file's characters that may be undecodable (replaced by U+FFFD)
#: before the file is refused: a stray latin-1 name in a UTF-8 file passes, a latin-1 or
#: binary file does not.
MAX_UNDECODABLE_SHARE = 0.01

DecodeErrors = Literal["check", "replace"]


@dataclass
class DecodeReport:
    """Undecodable characters (replaced by U+FFFD) counted per file over a read.

    Example::

        >>> report = DecodeReport()
        >>> text = decode(b"caf\\xe9" + b" au lait" * 20, Path("menu.txt"), report=report)
        >>> text[:8], report.total, report.files
        ('caf\\ufffd au ', 1, 1)
    """

    total: int = 0
    files: int = 0
    #: the files with undecodable characters: (path, count, share of the file's characters)
    worst: list[tuple[str, int, float]] = field(default_factory=list)

    def add(self, file: str, count: int, share: float) -> None:
        """Count ``count`` undecodable characters of ``file`` (``share`` of its characters)."""
        if count:
            self.total += count
            self.files += 1
            if len(self.worst) < 5:
                self.worst.append((file, count, share))

    def merge(self, other: DecodeReport) -> None:
        """Add ``other``'s counts (a worker's) to these."""
        self.total += other.total
        self.files += other.files
        self.worst.extend(other.worst[: max(0, 5 - len(self.worst))])

    def summary(self) -> str:
        """One line for the user: the total and the files most affected; "" when none."""
        if not self.total:
            return ""
        files = ", ".join(f"{path} ({count}, {share:.2%})" for path, count, share in self.worst)
        return (
            f"{self.total:,} undecodable character(s) replaced by U+FFFD in {self.files} "
            f"file(s): {files}{', ...' if self.files > len(self.worst) else ''}"
        )


class _ReplacementCounter:
    """The codec error handler ``hp-train-count``: ``replace``'s U+FFFD, counted."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, error: UnicodeError) -> tuple[str, int]:
        if not isinstance(error, UnicodeDecodeError):
            raise error
        self.count += 1
        return "\ufffd", error.end


_HANDLER = "hp-train-count"
try:  # registered once per process: the counter is read back from the registry (decode)
    codecs.lookup_error(_HANDLER)
except LookupError:
    codecs.register_error(_HANDLER, _ReplacementCounter())


def decode(
    data: bytes,
    file: Path,
    *,
    encoding: str = "utf-8",
    decode_errors: DecodeErrors = "check",
    report: DecodeReport | None = None,
    key: str = "data.path",
) -> str:
    """``data`` (the bytes of ``file``) as text: undecodable bytes replaced by U+FFFD and counted.

    With ``decode_errors = "check"``, more than :data:`MAX_UNDECODABLE_SHARE` of the
    characters undecodable is refused (ValueError naming the file and its share).

    Example::

        >>> decode(bytes(range(128, 256)), Path("blob.bin"))
        Traceback (most recent call last):
        ...
        ValueError: data.path: blob.bin: 100.00% of its 128 characters are not utf-8 (128 replaced by U+FFFD); expected at most 1%: set data.encoding to the file's encoding, or data.decode_errors = "replace" to train on the replacements
    """
    try:
        return data.decode(encoding)
    except UnicodeDecodeError:
        pass
    counter = cast(_ReplacementCounter, codecs.lookup_error(_HANDLER))
    before = counter.count
    text = data.decode(encoding, errors=_HANDLER)
    bad = counter.count - before
    share = bad / max(len(text), 1)
    if decode_errors == "check" and share > MAX_UNDECODABLE_SHARE:
        raise ValueError(
            f"{key}: {file}: {share:.2%} of its {len(text):,} characters are not {encoding} "
            f"({bad:,} replaced by U+FFFD); expected at most {MAX_UNDECODABLE_SHARE:.0%}: set "
            'data.encoding to the file\'s encoding, or data.decode_errors = "replace" to train '
            "on the replacements"
        )
    if report is not None:
        report.add(str(file), bad, share)
    return text


def universal_newlines(text: str) -> str:
    """``\\r\\n`` and ``\\r`` as ``\\n``, as Python's text files read them."""
    if "\r" not in text:
        return text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def documents_of_text(
    text: str, file: Path, *, as_jsonl: bool, field: str, key: str, first_line: int = 1
) -> list[str]:
    """The documents of one file's text: itself, or each non-blank JSONL line's ``field``.

    ``first_line`` numbers the text's first line in errors (a part of a larger file).

    Example::

        >>> documents_of_text('{"text": "a"}\\n\\n{"text": "b"}', Path("d.jsonl"), as_jsonl=True,
        ...                   field="text", key="data.path")
        ['a', 'b']
    """
    if not as_jsonl:
        return [text]
    found = []
    for number, line in enumerate(text.splitlines(), start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(
                f"{key}: {file}:{number}: expected a JSON object, found {error}"
            ) from error
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{key}: {file}:{number}: expected an object with a string field "
                f"{field!r} (data.field), found keys {keys}"
            )
        found.append(record[field])
    return found


def builtin_corpus() -> list[Path]:
    """The built-in corpus: the first ~2 MB of the Python standard library's own sources.

    Found at run time (no download, nothing shipped); the same files on every rank.

    Example::

        >>> all(path.suffix == ".py" for path in builtin_corpus())
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= BUILTIN_CORPUS_BYTES:
            break
    if not files:
        raise FileNotFoundError(f"data.path = '': no Python sources in the standard library {root}")
    return files


def is_hf_dataset(path: Path) -> bool:
    """Whether ``path`` is a ``datasets`` ``save_to_disk`` directory."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def find_files(path: str, *, key: str = "data.path") -> list[Path]:
    """The files ``path`` names: a file, every file under a directory, or a glob's matches.

    Example::

        >>> find_files("/nonexistent/*.txt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: data.path = '/nonexistent/*.txt': expected a file, a directory or a glob matching files, found no match
    """
    target = Path(path)
    if target.is_file():
        return [target]
    if target.is_dir():
        found = [p for p in sorted(target.rglob("*")) if p.is_file() and not _hidden(p, target)]
    else:
        found = [Path(p) for p in sorted(glob.glob(path, recursive=True)) if Path(p).is_file()]
    if not found:
        raise FileNotFoundError(
            f"{key} = {path!r}: expected a file, a directory or a glob matching files, "
            "found no match"
        )
    return found


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def reads_as_jsonl(file: Path, format: str) -> bool:
    """Whether ``file`` is read as JSONL under ``data.format = format``."""
    return format == "jsonl" or (format == "auto" and file.suffix.lower() in (".jsonl", ".json"))


def read_documents(
    path: str,
    *,
    format: str = "auto",
    field: str = "text",
    key: str = "data.path",
    encoding: str = "utf-8",
    decode_errors: DecodeErrors = "check",
    report: DecodeReport | None = None,
) -> Iterator[str]:
    """The documents of ``path``: each text file, each JSONL line's ``field``, each dataset row's.

    ``""`` is the built-in corpus. ``format`` ``"auto"`` reads ``.jsonl``/``.json`` files as
    JSONL, a ``save_to_disk`` directory as a dataset and anything else as text.
    Undecodable characters are counted into ``report`` (see :func:`decode`).

    Example::

        >>> isinstance(next(read_documents("")), str)
        True
    """
    if path and (format == "hf" or (format == "auto" and is_hf_dataset(Path(path)))):
        yield from dataset_documents(path, field, key)
        return
    files = builtin_corpus() if not path else find_files(path, key=key)
    for file in files:
        raw = decode(
            file.read_bytes(),
            file,
            encoding=encoding,
            decode_errors=decode_errors,
            report=report,
            key=key,
        )
        yield from documents_of_text(
            universal_newlines(raw),
            file,
            as_jsonl=reads_as_jsonl(file, format),
            field=field,
            key=key,
        )


def load_dataset(path: str, field: str, key: str) -> Any:
    """The ``datasets`` table at ``path`` (a DatasetDict's ``train`` split, else its first)."""
    try:
        datasets: Any = importlib.import_module("datasets")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"{key} = {path!r} is a Hugging Face datasets directory: pip install 'hp-train[datasets]'"
        ) from error
    loaded: Any = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    if field not in loaded.column_names:
        raise ValueError(
            f"{key} = {path!r}: expected a column {field!r} (data.field), found "
            f"{loaded.column_names}"
        )
    return loaded


def dataset_documents(path: str, field: str, key: str) -> Iterator[str]:
    """The ``field`` of each row of the dataset at ``path``, as text."""
    for row in load_dataset(path, field, key):
        yield str(row[field])

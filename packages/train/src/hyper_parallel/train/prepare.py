"""``hp-train prepare``: tokenize a corpus once, in worker processes, into memory-mapped token shards.

INPUT is split into parts of about :data:`PART_BYTES` (whole files; large JSONL files at
line boundaries; dataset rows by range); each worker reads, decodes and tokenizes a part
exactly as ``data.path`` does (:mod:`~hyper_parallel.train.documents`) and writes it as one
shard. Everything is written into a hidden directory beside OUT, renamed to OUT once
``index.json`` is complete: a killed ``prepare`` leaves no OUT that looks prepared.
"""

from __future__ import annotations

import argparse
import codecs
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from hyper_parallel.train.documents import (
    DecodeErrors,
    DecodeReport,
    decode,
    documents_of_text,
    find_files,
    is_hf_dataset,
    load_dataset,
    reads_as_jsonl,
    universal_newlines,
)
from hyper_parallel.train.shards import (
    DOCUMENTS_FILE,
    FORMAT,
    INDEX_FILE,
    token_dtype,
    tokenizer_identity,
)

__all__ = ["PART_BYTES", "PrepareOptions", "PrepareSummary", "prepare", "prepare_main"]

#: The input bytes of one worker's part (one shard); a part is never smaller than a file
#: that is not JSONL (a text file is one document).
PART_BYTES = 64 << 20


@dataclass(frozen=True)
class PrepareOptions:
    """What to prepare and how: ``hp-train prepare``'s arguments."""

    input: str
    out: str
    tokenizer_path: str = ""
    format: str = "auto"
    field: str = "text"
    encoding: str = "utf-8"
    decode_errors: DecodeErrors = "check"
    #: worker processes (0: one per core)
    workers: int = 0
    overwrite: bool = False
    part_bytes: int = PART_BYTES


@dataclass
class PrepareSummary:
    """What ``prepare`` wrote: counts, dtype, seconds, undecodable characters."""

    out: str
    documents: int
    tokens: int
    dtype: str
    shards: int
    input_bytes: int
    seconds: float
    decode: DecodeReport = field(default_factory=DecodeReport)

    def line(self) -> str:
        """One line for the user."""
        rate = self.input_bytes / max(self.seconds, 1e-9) / 1e6
        text = (
            f"[hp-train prepare] {self.out}: {self.documents:,} documents, {self.tokens:,} "
            f"tokens ({self.dtype}) in {self.shards} shard(s); {self.input_bytes / 1e6:,.1f} MB "
            f"in {self.seconds:.1f} s ({rate:,.1f} MB/s)"
        )
        if self.decode.total:
            text += "\n[hp-train prepare] " + self.decode.summary()
        return text


@dataclass(frozen=True)
class _Piece:
    """Bytes ``start .. stop`` of a file (whole file: ``stop = -1``) or rows of a dataset."""

    file: str
    start: int = 0
    stop: int = -1
    first_line: int = 1


@dataclass(frozen=True)
class _Part:
    number: int
    pieces: tuple[_Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class _Result:
    number: int
    name: str
    tokens: int
    lengths: npt.NDArray[np.int64]
    nbytes: int
    decode: DecodeReport


def prepare(options: PrepareOptions, *, progress: TextIO | None = None) -> PrepareSummary:
    """Tokenize ``options.input`` into ``options.out`` (see the module); the summary of what was written.

    Example::

        prepare(PrepareOptions("corpus/", "prepared/"), progress=sys.stderr)  # doctest: +SKIP
    """
    started = time.perf_counter()
    out = Path(options.out)
    _check_out(out, options.overwrite)
    identity = tokenizer_identity(options.tokenizer_path)
    vocab_size, eos_id = _vocabulary(options.tokenizer_path)
    dtype = token_dtype(vocab_size)
    workers = options.workers or os.cpu_count() or 1
    parts, hf = _plan(options, workers)
    total = sum(part.nbytes for part in parts)
    scratch = out.parent / f".{out.name}.prepare-{os.getpid()}"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    try:
        tasks = [(part, options, str(scratch), dtype, eos_id, hf) for part in parts]
        results: list[_Result] = []
        bar = _Progress(total, progress)
        for result in _run(tasks, min(workers, max(len(parts), 1))):
            results.append(result)
            bar.advance(result.nbytes, sum(len(r.lengths) for r in results))
        bar.finish()
        report = DecodeReport()
        lengths = [r.lengths for r in results]
        for r in results:
            report.merge(r.decode)
        everything = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        starts = (np.cumsum(everything) - everything).astype("<i8")
        starts.tofile(scratch / DOCUMENTS_FILE)
        shards = [
            {"name": r.name, "tokens": r.tokens, "bytes": r.tokens * np.dtype(dtype).itemsize}
            for r in results
            if r.tokens
        ]
        index: dict[str, Any] = {
            "format": FORMAT,
            "version": 1,
            "tokenizer": identity,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "dtype": dtype,
            "byteorder": "little",
            "documents": len(everything),
            "tokens": int(everything.sum()),
            "documents_file": DOCUMENTS_FILE,
            "shards": shards,
            "source": {"input": options.input, "format": options.format, "field": options.field},
            "undecodable_characters": report.total,
        }
        (scratch / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        _swap_in(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return PrepareSummary(
        out=str(out),
        documents=int(index["documents"]),
        tokens=int(index["tokens"]),
        dtype=dtype,
        shards=len(shards),
        input_bytes=total,
        seconds=time.perf_counter() - started,
        decode=report,
    )


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"prepare OUT = {str(out)!r}: expected a directory, found a file")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            entries = len(list(out.iterdir()))
            raise FileExistsError(
                f"prepare OUT = {str(out)!r}: expected an empty or new directory, found "
                f"{entries} entr{'y' if entries == 1 else 'ies'} (--overwrite replaces a "
                "prepared directory)"
            )
        if not (out / INDEX_FILE).is_file():
            raise FileExistsError(
                f"prepare OUT = {str(out)!r}: --overwrite replaces only a directory prepared by "
                f"hp-train prepare (with an {INDEX_FILE}), found other files"
            )


def _swap_in(scratch: Path, out: Path) -> None:
    """``scratch`` becomes ``out`` by renames: at no point is there a partial ``out``."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    scratch.rename(out)
    if old.exists():
        shutil.rmtree(old)


def _vocabulary(tokenizer_path: str) -> tuple[int, int]:
    """``(vocab_size, eos_id)`` of the job's tokenizer (as :func:`build_tokenizer` makes it)."""
    if not tokenizer_path:
        from hyper_parallel.train.tokenizer import BYTE_EOS

        return BYTE_EOS + 1, BYTE_EOS
    from hyper_parallel.train.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(tokenizer_path)
    return tokenizer.vocab_size, tokenizer.eos_id


def _plan(options: PrepareOptions, workers: int) -> tuple[list[_Part], bool]:
    """The parts of the input in document order, and whether it is a ``datasets`` directory.

    Parts are at most ``options.part_bytes``, and small enough that every worker gets
    about four (the last parts of a worker do not leave the others idle for long).
    """
    key = "prepare INPUT"
    if options.format == "hf" or (options.format == "auto" and is_hf_dataset(Path(options.input))):
        table = load_dataset(options.input, options.field, key)
        rows = len(table)
        size = max(int(getattr(table.data, "nbytes", 0)), 1)
        per_row = size / max(rows, 1)
        target = min(options.part_bytes, max(size // (workers * 4), 1 << 20))
        step = max(1, int(target / max(per_row, 1)))
        by_rows = [
            _Part(
                n,
                (_Piece(options.input, a, min(a + step, rows)),),
                int(per_row * (min(a + step, rows) - a)),
            )
            for n, a in enumerate(range(0, rows, step))
        ]
        return by_rows, True
    files = [(file, file.stat().st_size) for file in find_files(options.input, key=key)]
    target = min(options.part_bytes, max(sum(s for _, s in files) // (workers * 4), 1 << 20))
    # a newline byte ends a line only in ASCII-compatible encodings (not UTF-16, ...)
    splittable = "\n".encode(options.encoding) == b"\n"
    pieces: list[tuple[_Piece, int]] = []
    for file, size in files:
        if splittable and reads_as_jsonl(file, options.format) and size > target:
            pieces += _jsonl_pieces(file, size, target)
        else:
            pieces.append((_Piece(str(file)), size))
    parts: list[_Part] = []
    current: list[_Piece] = []
    nbytes = 0
    for piece, size in pieces:
        if current and nbytes + size > target:
            parts.append(_Part(len(parts), tuple(current), nbytes))
            current, nbytes = [], 0
        current.append(piece)
        nbytes += size
    if current:
        parts.append(_Part(len(parts), tuple(current), nbytes))
    return parts, False


def _jsonl_pieces(file: Path, size: int, part_bytes: int) -> list[tuple[_Piece, int]]:
    """A large JSONL file cut after newlines into pieces of about ``part_bytes``."""
    pieces = []
    start, line = 0, 1
    with file.open("rb") as handle:
        while start < size:
            stop = min(start + part_bytes, size)
            handle.seek(stop)
            while stop < size:  # on to the end of the line that crosses the cut
                chunk = handle.read(1 << 16)
                found = chunk.find(b"\n")
                if found >= 0 or not chunk:
                    stop = min(stop + found + 1, size) if found >= 0 else size
                    break
                stop += len(chunk)
            handle.seek(start)
            lines = handle.read(stop - start).count(b"\n")
            pieces.append((_Piece(str(file), start, stop, line), stop - start))
            line += lines
            start = stop
    return pieces


def _run(tasks: list[tuple[Any, ...]], workers: int) -> Iterator[_Result]:
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _work(task)
        return
    # fork is fast (no re-import) and safe while this process runs no other thread
    method = "fork" if threading.active_count() == 1 and sys.platform == "linux" else "spawn"
    with multiprocessing.get_context(method).Pool(workers, initializer=_worker_init) as pool:
        yield from pool.imap(_work, tasks)


def _worker_init() -> None:
    # each worker is one core: no nested thread pools
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _work(task: tuple[Any, ...]) -> _Result:
    part, options, scratch, dtype, eos_id, hf = task
    report = DecodeReport()
    documents = _read_part(part, options, hf, report)
    tokens, lengths = _tokenize(documents, options.tokenizer_path, dtype, eos_id)
    name = f"tokens-{part.number:05d}.bin"
    if len(tokens):
        tokens.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tofile(Path(scratch) / name)
    return _Result(part.number, name, len(tokens), lengths, part.nbytes, report)


def _read_part(part: _Part, options: PrepareOptions, hf: bool, report: DecodeReport) -> list[str]:
    key = "prepare INPUT"
    if hf:
        (piece,) = part.pieces
        table = load_dataset(piece.file, options.field, key)
        return [str(text) for text in table[piece.start : piece.stop][options.field]]
    documents: list[str] = []
    for piece in part.pieces:
        file = Path(piece.file)
        with file.open("rb") as handle:
            handle.seek(piece.start)
            data = handle.read() if piece.stop < 0 else handle.read(piece.stop - piece.start)
        text = decode(
            data,
            file,
            encoding=options.encoding,
            decode_errors=options.decode_errors,
            report=report,
            key=key,
        )
        documents += documents_of_text(
            universal_newlines(text),
            file,
            as_jsonl=reads_as_jsonl(file, options.format),
            field=options.field,
            key=key,
            first_line=piece.first_line,
        )
    return documents


def _tokenize(
    documents: list[str], tokenizer_path: str, dtype: str, eos_id: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64]]:
    """The documents' ids, each followed by EOS, as one ``dtype`` array; each one's length."""
    pieces: list[Any]
    if not tokenizer_path:
        pieces = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in documents]
    else:
        from tokenizers import Tokenizer

        file = Path(tokenizer_path)
        tokenizer = Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))
        encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
        pieces = [e.ids for e in encoded]
    lengths = np.fromiter((len(p) + 1 for p in pieces), dtype=np.int64, count=len(pieces))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    position = 0
    for piece in pieces:  # a copy per document: cheaper than masks over the whole part
        stop = position + len(piece)
        out[position:stop] = piece
        out[stop] = eos_id
        position = stop + 1
    return out, lengths


class _Progress:
    """A one-line progress bar on ``stream``: MB done, MB/s, ETA, documents."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.stream = max(total, 1), stream
        self.done, self.start, self.shown = 0, time.perf_counter(), 0.0

    def advance(self, nbytes: int, documents: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.stream is None or (now - self.shown < 0.25 and self.done < self.total):
            return
        self.shown = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0
        filled = int(20 * self.done / self.total)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (20 - filled)}] {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB"
            f"  {rate / 1e6:,.1f} MB/s  ETA {eta:,.0f}s  {documents:,} documents"
        )
        self.stream.flush()

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def prepare_main(argv: list[str]) -> int:
    """``hp-train prepare INPUT OUT [...]``; the exit status (0 done, 2 bad input).

    Example::

        >>> prepare_main(["/nonexistent/*.txt", "/tmp/never-written"])  # doctest: +SKIP
        2
    """
    parser = argparse.ArgumentParser(
        prog="hp-train prepare",
        description="Tokenize INPUT once into memory-mapped token shards in OUT (index.json, "
        "tokens-*.bin, documents.bin); a job reads them with data.path = OUT.",
    )
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="what data.path reads: a file, a "
        "directory, a glob, JSONL, or a datasets save_to_disk directory",
    )
    parser.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    parser.add_argument(
        "--tokenizer.path",
        dest="tokenizer_path",
        default="",
        help="a tokenizer.json (or its directory); default: the byte tokenizer",
    )
    parser.add_argument(
        "--data.format", dest="format", default="auto", choices=["auto", "text", "jsonl", "hf"]
    )
    parser.add_argument(
        "--data.field",
        dest="field",
        default="text",
        help="the JSONL / datasets field holding the text",
    )
    parser.add_argument("--data.encoding", dest="encoding", default="utf-8")
    parser.add_argument(
        "--data.decode_errors", dest="decode_errors", default="check", choices=["check", "replace"]
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="worker processes (default: one per core)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT when it holds prepared data"
    )
    args = parser.parse_args(argv)
    if not args.input:
        parser.error(
            "INPUT: expected a file, a directory, a glob or a datasets directory, found ''"
        )
    try:
        codecs.lookup(args.encoding)
    except LookupError:
        parser.error(
            f"--data.encoding: expected a text encoding Python knows, found {args.encoding!r}"
        )
    if args.workers < 0:
        parser.error(f"--workers: expected an int >= 0 (0: one per core), found {args.workers}")
    options = PrepareOptions(
        input=args.input,
        out=args.out,
        tokenizer_path=args.tokenizer_path,
        format=args.format,
        field=args.field,
        encoding=args.encoding,
        decode_errors=args.decode_errors,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    try:
        summary = prepare(options, progress=sys.stderr)
    except (
        FileNotFoundError,
        FileExistsError,
        ModuleNotFoundError,
        ValueError,
        LookupError,
    ) as error:
        print(f"hp-train prepare: error: {error}", file=sys.stderr)
        return 2
    print(summary.line(), file=sys.stderr)
    return 0

"""A checkpoint's manifest: the size and SHA-256 of each of its files, checked before it is read.

``manifest.json`` is written last into a finished checkpoint directory (to a temporary
name, then renamed), so a directory holding it holds every file it lists. Reading it is
JSON only: it is checked before DCP's ``.metadata`` (a pickle) or any shard is opened.

The manifest finds damage (a truncated, zeroed or overwritten file), not intent: whoever
can write a checkpoint's files can write its manifest too. Loading a checkpoint runs
code its pickles name, as ``torch.load`` does: load only checkpoints you trust.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "damage", "manifest_order", "read_manifest", "write_manifest"]

#: The manifest's file name inside a checkpoint directory.
MANIFEST = "manifest.json"
_TEMPORARY = f".{MANIFEST}.tmp"
_VERSION = 1
_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_all(paths: Sequence[Path]) -> list[str]:
    """The SHA-256 of each of ``paths``, several files at once (hashlib releases the GIL)."""
    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def _listed_files(directory: Path) -> list[Path]:
    """The files a manifest covers: every file under ``directory`` except the manifest."""
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, _TEMPORARY)
    )


def write_manifest(directory: str | os.PathLike[str], info: dict[str, Any] | None = None) -> Path:
    """Write ``directory/manifest.json``: each file's size and SHA-256, and ``info`` (JSON values).

    Call it once every file of the checkpoint is written (one process). Returns its path.

    Example::

        write_manifest("ckpt/.step-10.partial", info={"seed": 0})
    """
    root = Path(directory)
    listed = _listed_files(root)
    files = {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": digest}
        for p, digest in zip(listed, _sha256_all(listed), strict=True)
    }
    body = {"version": _VERSION, "files": files, "info": dict(info or {})}
    temporary = root / _TEMPORARY
    with temporary.open("w", encoding="utf-8") as out:
        json.dump(body, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    final = root / MANIFEST
    os.replace(temporary, final)
    return final


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``directory`` (``None``: it has none); ValueError when it is unreadable.

    Example::

        >>> read_manifest("/nonexistent") is None
        True
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    problem = _unreadable(path)
    if isinstance(problem, str):
        raise ValueError(f"{path} {problem}")
    return problem


def _unreadable(path: Path) -> dict[str, Any] | str:
    """The manifest at ``path``, or what makes it unreadable."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"is unreadable ({error})"
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
        for e in files.values()
    ):
        return "is unreadable (expected a 'files' map of each file's size and sha256)"
    checked: dict[str, Any] = body
    return checked


def damage(
    directory: str | os.PathLike[str], share: tuple[int, int] = (0, 1)
) -> tuple[str, str] | None:
    """``(file, what is wrong)`` for the first file of ``directory`` off its manifest, else None.

    A directory without a manifest has nothing to check against: None (the caller decides).
    Sizes are compared first (a stat per file), then the SHA-256 of the files.
    ``share=(i, n)`` hashes only every ``n``-th file from the ``i``-th in the manifest's
    order (one of ``n`` processes checking a checkpoint together; each still checks the
    manifest and every size).

    Example::

        >>> damage("/nonexistent") is None
        True
    """
    index, count = share
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"damage: expected share=(i, n) with 0 <= i < n, found {share!r}")
    root = Path(directory)
    if not (root / MANIFEST).is_file():
        return None
    manifest = _unreadable(root / MANIFEST)
    if isinstance(manifest, str):
        return MANIFEST, manifest
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name, expected in sorted(files.items()):
        path = root / name
        if not path.is_file():
            return name, "is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return name, f"has {size} bytes, expected {expected['size']}"
    mine = sorted(files.items())[index::count]
    for (name, expected), found in zip(
        mine, _sha256_all([root / name for name, _ in mine]), strict=True
    ):
        if found != expected["sha256"]:
            return name, (
                f"has SHA-256 {found[:16]}..., expected {expected['sha256'][:16]}... "
                "(its bytes changed after the save)"
            )
    return None


def manifest_order(directory: str | os.PathLike[str]) -> list[str]:
    """The files of ``directory``'s manifest in the order :func:`damage` checks them ([] if none).

    Example::

        >>> manifest_order("/nonexistent")
        []
    """
    try:
        manifest = read_manifest(directory)
    except ValueError:
        return []
    return sorted(manifest["files"]) if manifest is not None else []

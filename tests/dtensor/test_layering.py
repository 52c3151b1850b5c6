"""hp-dtensor's imports follow the layering table of ``docs/DTENSOR_INTERNALS.md``.

The table lists the package's files from the top layer to the bottom one; a file may
import files of its own row or of rows below it. This test reads the table and every
file's imports (``ast``: no module is imported) and names each file and import that
breaks it: an import of a row above, an import of the package inside a function (the
knot the table forbids), a file the table does not list, or an import of hp-dmodule.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
from tests._package_files import module_file

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE = _ROOT / "packages" / "dtensor" / "src" / "hyper_parallel" / "dtensor"
_DOC = _ROOT / "docs" / "DTENSOR_INTERNALS.md"
_NAME = "hyper_parallel.dtensor"


def _table() -> list[list[str]]:
    """The rows of the layering table, top first: each a list of file patterns."""
    rows: list[list[str]] = []
    in_table = False
    for line in _DOC.read_text().splitlines():
        if line.startswith("| file | concern |"):
            in_table = True
            continue
        if in_table:
            if not line.startswith("|"):
                break
            cell = line.split("|")[1]
            patterns = re.findall(r"`([^`]+)`", cell)
            if patterns:
                rows.append(patterns)
    return rows


def _files() -> list[str]:
    return sorted(p.relative_to(_PACKAGE).as_posix() for p in _PACKAGE.rglob("*.py"))


def _row_of(path: str, rows: list[list[str]]) -> int | None:
    """The row that names ``path``, else the first row (from the top) with a matching pattern."""
    for i, patterns in enumerate(rows):
        if path in patterns:
            return i
    for i, patterns in enumerate(rows):
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns):
            return i
    return None


def _module_file(module: str) -> str | None:
    """The package file of a dotted module name (``None``: not a file of hp-dtensor)."""
    return module_file(_PACKAGE, _NAME, module)


def _imports(path: str) -> list[tuple[int, str, bool]]:
    """``(line, module, at_top)`` of every import of a ``hyper_parallel`` module in a file.

    Imports under ``if TYPE_CHECKING:`` are left out (annotations only). ``from pkg import
    name`` counts as importing ``pkg.name`` where that is a module, else ``pkg``.
    """
    tree = ast.parse((_PACKAGE / path).read_text())
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, at_top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other, at_top)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("hyper_parallel"):
                        found.append((child.lineno, alias.name, at_top))
            elif (
                isinstance(child, ast.ImportFrom)
                and child.level == 0
                and (child.module or "").startswith("hyper_parallel")
            ):
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    module = sub if _module_file(sub) is not None else str(child.module)
                    found.append((child.lineno, module, at_top))
            top = at_top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
            )
            visit(child, top)

    visit(tree, True)
    return found


def _violations() -> list[str]:
    rows = _table()
    problems: list[str] = []
    for path in _files():
        row = _row_of(path, rows)
        if row is None:
            problems.append(f"{path}: not listed in the table of {_DOC.name}")
            continue
        for line, module, at_top in _imports(path):
            where = f"{path}:{line}: import {module}"
            if module.startswith("hyper_parallel.dmodule"):
                problems.append(f"{where}: hp-dtensor never imports hp-dmodule")
                continue
            target = _module_file(module)
            if target is None:
                continue  # another package below hp-dtensor (config, platform)
            if not at_top:
                problems.append(f"{where}: inside a function (imports go at the top)")
            target_row = _row_of(target, rows)
            if target_row is not None and target_row < row:
                problems.append(
                    f"{where}: {target} is in a row above {path} ({rows[target_row]} over "
                    f"{rows[row]})"
                )
    return problems


def test_table_lists_known_files() -> None:
    """The parser sees the table: its top row is the package's __init__, rules sit below planning."""
    rows = _table()
    assert rows[0] == ["__init__.py"]
    assert _row_of("_ops/pointwise.py", rows) == _row_of("_ops/views.py", rows)
    assert _row_of("_ops/specials.py", rows) == _row_of("_ops/loss_specials.py", rows)
    rule_row = _row_of("_ops/pointwise.py", rows)
    assert rule_row is not None
    assert rule_row > (_row_of("_planning.py", rows) or 0)
    assert (_row_of("_tensor.py", rows) or 0) > (_row_of("_ops/random.py", rows) or 0)
    assert (_row_of("_ops/_strategy.py", rows) or 0) > rule_row  # named: below the rules


def test_imports_follow_the_table() -> None:
    problems = _violations()
    assert not problems, "imports that break docs/DTENSOR_INTERNALS.md's table:\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from hyper_parallel.dtensor._tensor import DTensor\n", "is in a row above"),
        ("def f():\n    from hyper_parallel.dtensor import _spec\n", "inside a function"),
        ("from hyper_parallel.dmodule import Module\n", "never imports hp-dmodule"),
    ],
)
def test_a_broken_import_is_named(
    source: str, expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rule module that imports upwards, or inside a function, is reported with file and line."""
    fake = tmp_path / "dtensor"
    for p in _PACKAGE.rglob("*.py"):
        dst = fake / p.relative_to(_PACKAGE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(p.read_text())
    (fake / "_ops" / "pointwise.py").write_text(source)
    monkeypatch.setattr(f"{__name__}._PACKAGE", fake)
    problems = _violations()
    assert any(p.startswith("_ops/pointwise.py:") and expected in p for p in problems), problems

"""A package's tests import only what its users install plus its ``test`` extra.

The release rehearsal proves this by running the tests in a fresh venv (slow: see
test_rehearsal.py); these checks read the sources and the installed metadata instead, so a
missing declaration fails in a second, naming the file and the import.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hp_workspace import PACKAGES, ROOT, TEST_EXTRA, Package, read_pyproject, workspace_closure

NAMES = sorted(PACKAGES)


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """Absolute module names imported anywhere in ``path`` (lazy imports too), with lines."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def _test_imports(package: Package) -> dict[str, list[str]]:
    """Module -> where it is imported, over the package's tests and the ``tests.*`` helpers
    they import (followed transitively: ``tests._harness`` imports the torch adapter)."""
    found: dict[str, list[str]] = {}
    pending = sorted(package.tests_path.rglob("*.py"))
    seen: set[Path] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, line in _imports(path):
            if module == "tests" or module.startswith("tests."):
                helper = ROOT.joinpath(*module.split("."))
                pending += [
                    p for p in (helper.with_suffix(".py"), helper / "__init__.py") if p.is_file()
                ]
                continue
            found.setdefault(module, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _distribution_closure(name: str, extras: frozenset[str]) -> set[str]:
    """Canonical names of ``name[extras]`` and everything it requires, from installed metadata."""
    closure: set[str] = set()
    visited: set[tuple[str, frozenset[str]]] = set()
    pending = [(canonicalize_name(name), extras)]
    while pending:
        current, current_extras = pending.pop()
        if (current, current_extras) in visited:
            continue
        visited.add((current, current_extras))
        closure.add(current)
        try:
            requires = importlib.metadata.requires(current) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (torch-npu under the npu extra): nothing to follow
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in current_extras | {""}
            ):
                pending.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return closure


@pytest.mark.parametrize("name", NAMES)
def test_package_tests_import_no_sibling_the_package_does_not_require(name: str) -> None:
    package = PACKAGES[name]
    provided = {import_name for p in workspace_closure(package) for import_name in p.import_names}
    foreign = {
        module: where
        for module, where in _test_imports(package).items()
        if module.startswith("hyper_parallel.")
        and not any(module == own or module.startswith(own + ".") for own in provided)
    }
    assert foreign == {}, (
        f"{package.tests}/ imports {sorted(foreign)} (at {foreign}), which {name}'s users do not "
        f"have ({name} provides, with what it requires, {sorted(provided)}): move those tests "
        "to the package that provides the module, or make it a real dependency"
    )


@pytest.mark.parametrize("name", NAMES)
def test_package_tests_import_only_what_the_package_and_its_test_extra_install(
    name: str,
) -> None:
    package = PACKAGES[name]
    closure = _distribution_closure(name, frozenset({TEST_EXTRA}))
    owners = importlib.metadata.packages_distributions()
    undeclared: dict[str, list[str]] = {}
    for module, where in _test_imports(package).items():
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or module.startswith("hyper_parallel."):
            continue  # hyper_parallel: the test above
        distributions = {canonicalize_name(d) for d in owners.get(top, [])}
        if not distributions & closure:
            undeclared[f"{module} (from {sorted(distributions) or 'no distribution'})"] = where
    assert undeclared == {}, (
        f"{package.tests}/ imports what neither {name} nor {name}[{TEST_EXTRA}] installs: "
        f"{undeclared}; add it to the `{TEST_EXTRA}` extra in "
        f"{package.pyproject.relative_to(ROOT)} (not to the root dev group: the release "
        "rehearsal installs the package's extra only)"
    )


@pytest.mark.parametrize("name", NAMES)
def test_test_extra_brings_no_sibling_package_its_users_lack(name: str) -> None:
    package = PACKAGES[name]
    with_tests = [p.name for p in workspace_closure(package, (TEST_EXTRA,))]
    assert with_tests == [p.name for p in workspace_closure(package)]


def test_workspace_dev_group_installs_every_package_test_extra() -> None:
    dev = read_pyproject(ROOT / "pyproject.toml")["dependency-groups"]["dev"]
    declared = {str(Requirement(line)) for line in dev if isinstance(line, str)}
    for name in NAMES:
        assert f"{name}[{TEST_EXTRA}]" in declared, f"root dev group lacks {name}[{TEST_EXTRA}]"


@pytest.mark.parametrize("name", NAMES)
def test_every_package_declares_a_test_extra(name: str) -> None:
    extras = read_pyproject(PACKAGES[name].pyproject)["project"].get("optional-dependencies", {})
    assert TEST_EXTRA in extras, f"{PACKAGES[name].pyproject}: no `{TEST_EXTRA}` extra"

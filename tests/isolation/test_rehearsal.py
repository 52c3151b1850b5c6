"""The release rehearsal of each torch package, for real: build → fresh venv → install → test.

``release.rehearse`` is what ``scripts/release.py NAME X.Y.Z --dry-run`` runs after its
checks: the package built alone at the bumped version, a fresh venv holding it as its
users install it (sibling wheels, torch from PyPI at uv.lock's version) plus its ``test``
extra, and its tests run there. Here every test module of the package is collected (so any
import its users' install lacks fails), and a quick selection runs. hp-config's path is
covered in full by test_install.py and, on CPython 3.10 and 3.13, by CI (.ci/run).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import release
from hp_workspace import PACKAGES, read_version, workspace_closure

pytestmark = pytest.mark.isolation

#: What each rehearsal here runs (docs/RELEASING.md lists the same).
REHEARSAL_TESTS: dict[str, list[str]] = {
    # All of its tests (about 15 s).
    "hp-platform-torch": ["tests/platform"],
    # Platform discovery, and collective counts checked against torch's CommDebugMode.
    "hp-dtensor": ["tests/dtensor", "-k", "test_platform_discovery or cheapest_collective"],
    # Module basics, and the demo on 2 ranks writing its plot (the torch and demo extras).
    "hp-dmodule": ["tests/dmodule", "-k", "test_module_basics or test_demo_two_ranks"],
    # The job config and the data pipeline (one process each; the tensorboard extra is read).
    "hp-train": ["tests/train", "-k", "test_config or test_data or test_lr"],
}


def _next_patch(name: str) -> str:
    major, minor, patch = read_version(PACKAGES[name].pyproject).split(".")
    return f"{major}.{minor}.{int(patch) + 1}"


@pytest.mark.parametrize("name", sorted(REHEARSAL_TESTS))
def test_release_rehearsal_installs_as_users_do_and_passes_tests_in_a_fresh_venv(
    name: str, tmp_path: Path
) -> None:
    version = _next_patch(name)
    done = release.rehearse(PACKAGES[name], version, tmp_path, pytest_args=REHEARSAL_TESTS[name])
    assert done.built.wheel.name.startswith(f"{PACKAGES[name].wheel_stem}-{version}-")
    users = done.install.for_users
    assert users[name] == version
    assert users.keys() & PACKAGES.keys() == {p.name for p in workspace_closure(PACKAGES[name])}
    assert "torch" in users and "torch-npu" not in done.install.for_tests
    assert re.match(r"[1-9]\d* passed\b", done.tests), done.tests
    assert not re.search(r"\b(failed|error|errors)\b", done.tests), done.tests


def test_release_guide_names_what_the_rehearsal_tests_run() -> None:
    guide = Path(__file__).resolve().parents[2] / "docs" / "RELEASING.md"
    text = guide.read_text(encoding="utf-8")
    for name, args in REHEARSAL_TESTS.items():
        assert " ".join(args) in text, f"docs/RELEASING.md: no `{' '.join(args)}` ({name})"

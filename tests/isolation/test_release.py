"""scripts/release.py refuses bad releases before touching anything; README and CI agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import check_install
import release
from hp_workspace import (
    PACKAGES,
    ROOT,
    StepError,
    find_python,
    python_version,
    read_pyproject,
    read_version,
    with_torch,
    workspace_closure,
    write_version,
)


@pytest.mark.parametrize("bad", ["0.1", "v0.2.0", "0.2.0.dev1", "01.2.3", "0.2.0-rc1", "0.2"])
def test_release_rejects_versions_that_are_not_major_minor_patch(bad: str) -> None:
    with pytest.raises(StepError, match=r"is not MAJOR\.MINOR\.PATCH"):
        release.validate_version(PACKAGES["hp-config"], bad)


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_release_rejects_versions_not_above_the_current_one(name: str) -> None:
    current = read_version(PACKAGES[name].pyproject)
    with pytest.raises(
        StepError, match=f"must be greater than the current version {re.escape(current)}"
    ):
        release.validate_version(PACKAGES[name], current)


def test_release_accepts_patch_minor_major_and_pre_releases() -> None:
    major, minor, patch = (
        int(part) for part in read_version(PACKAGES["hp-config"].pyproject).split(".")
    )
    for version in (
        f"{major}.{minor}.{patch + 1}",
        f"{major}.{minor + 1}.0",
        f"{major}.{minor + 1}.0rc1",
        f"{major + 1}.0.0",
    ):
        assert str(release.validate_version(PACKAGES["hp-config"], version)) == version


def test_release_requires_a_changelog_entry_for_the_new_version() -> None:
    with pytest.raises(StepError, match=r"packages/config/CHANGELOG.md has no entry for 99\.0\.0"):
        release.check_changelog(PACKAGES["hp-config"], "99.0.0")
    release.check_changelog(PACKAGES["hp-config"], read_version(PACKAGES["hp-config"].pyproject))


def test_write_version_changes_only_the_project_version_line(tmp_path: Path) -> None:
    original = PACKAGES["hp-platform-torch"].pyproject.read_text(encoding="utf-8")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(original + '\n[tool.other]\nversion = "9.9.9"\n', encoding="utf-8")
    before = pyproject.read_text(encoding="utf-8").splitlines()
    write_version(pyproject, "7.8.9")
    after = pyproject.read_text(encoding="utf-8").splitlines()
    changed = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    assert changed == [
        (
            f'version = "{read_version(PACKAGES["hp-platform-torch"].pyproject)}"',
            'version = "7.8.9"',
        )
    ]
    assert read_version(pyproject) == "7.8.9"


@pytest.mark.parametrize(
    ("name", "extras", "expected"),
    [
        ("hp-config", (), ["hp-config"]),
        ("hp-platform-torch", ("npu",), ["hp-platform-torch"]),
        ("hp-dtensor", (), ["hp-dtensor", "hp-platform-torch"]),
        ("hp-dmodule", (), ["hp-dmodule", "hp-config", "hp-dtensor", "hp-platform-torch"]),
        ("hp-dmodule", ("torch",), ["hp-dmodule", "hp-config", "hp-dtensor", "hp-platform-torch"]),
        (
            "hp-train",
            (),
            ["hp-train", "hp-dmodule", "hp-config", "hp-dtensor", "hp-platform-torch"],
        ),
    ],
)
def test_release_installs_exactly_the_workspace_packages_a_package_needs(
    name: str, extras: tuple[str, ...], expected: list[str]
) -> None:
    assert sorted(p.name for p in workspace_closure(PACKAGES[name], extras)) == sorted(expected)


def test_ci_runs_the_readme_demo_and_test_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in (
        "uv run --frozen python -m hyper_parallel.dmodule.demo",
        "uv run --frozen pytest",
    ):
        assert f"python3 -m pip install uv && {command}" in readme, command
        assert command in ci, command


def test_ci_tests_on_the_lowest_python_the_packages_declare() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    floors = {
        name: read_pyproject(package.pyproject)["project"]["requires-python"]
        for name, package in PACKAGES.items()
    }
    assert set(floors.values()) == {">=3.10"}, floors
    assert "scripts/check_install.py hp-config --python 3.10 --python 3.13" in ci
    assert "scripts/check_install.py hp-dmodule --python 3.10 --demo-steps 3" in ci


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split("."))


def test_ci_tests_both_ends_of_the_torch_range_the_packages_declare() -> None:
    """The declared floor is the lock's torch (every stage runs it); CI adds a newer release."""
    platform = read_pyproject(PACKAGES["hp-platform-torch"].pyproject)["project"]
    dmodule = read_pyproject(PACKAGES["hp-dmodule"].pyproject)["project"]
    declared = {
        req
        for req in [*platform["dependencies"], *dmodule["optional-dependencies"]["torch"]]
        if req.startswith("torch")
    }
    assert len(declared) == 1, declared
    floor = declared.pop().removeprefix("torch>=")
    lock = (ROOT / "uv.lock").read_text(encoding="utf-8")
    locked = re.search(r'name = "torch"\nversion = "([^"]+)"', lock)
    assert locked is not None
    assert _release(locked.group(1))[:2] == _release(floor)[:2], (floor, locked.group(1))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    newest = re.search(r"scripts/check_install.py hp-dmodule --torch (\S+) -- ", ci)
    assert newest is not None, "no CI stage runs the tests on another torch"
    assert _release(newest.group(1)) > _release(locked.group(1)), newest.group(1)


def test_with_torch_pins_that_torch_and_frees_what_follows_it(tmp_path: Path) -> None:
    locked = tmp_path / "constraints.txt"
    locked.write_text(
        "numpy==2.1.0\ntorch==2.14.0\ntriton==3.8.0 ; sys_platform == 'linux'\n"
        "nvidia-cublas==13.0.0.19 ; sys_platform == 'linux'\npytest==9.0.0\n",
        encoding="utf-8",
    )
    pins = with_torch(locked, "2.15.0").read_text(encoding="utf-8").splitlines()
    assert pins == ["numpy==2.1.0", "pytest==9.0.0", "torch==2.15.0"]


def _demo_rows(text: str) -> tuple[list[str], list[str]]:
    """The sharding-plan rows and collective rows of demo output (or of a README sample)."""
    plan = re.findall(r"^ +\S+ +weight +\[.*\)$", text, re.MULTILINE)
    collectives = re.findall(r"^ +(?:all_\w+|reduce_scatter\w*) +x\d+ +[\d.]+ \w+$", text, re.M)
    return [row.strip() for row in plan], [row.strip() for row in collectives]


def _default_run_sample(readme: Path) -> str:
    """The README's first code block of demo output: the default run's (later ones show options)."""
    blocks = readme.read_text(encoding="utf-8").split("```")[1::2]
    return next(b for b in blocks if "collectives per training step" in b)


def test_readme_demo_samples_match_a_real_run_of_the_demo(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.dmodule.demo", "--steps", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    plan, collectives = _demo_rows(done.stdout)
    assert plan and collectives, done.stdout
    for readme in (ROOT / "README.md", PACKAGES["hp-dmodule"].path / "README.md"):
        sample_plan, sample_collectives = _demo_rows(_default_run_sample(readme))
        where = readme.relative_to(ROOT)
        assert sample_collectives == collectives, f"{where}: sample collectives are stale"
        assert sample_plan and set(sample_plan) <= set(plan), f"{where}: sample plan is stale"


def test_find_python_finds_a_working_cpython_of_the_asked_version() -> None:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = find_python(version)
    assert found is not None
    assert python_version(found).startswith(f"{version}.")
    assert find_python("3.99") is None


def test_check_install_skips_an_absent_python_with_a_notice_and_fails_with_require(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check_install.main(["hp-config", "--python", "3.99"]) == 0
    assert "NOTICE: CPython 3.99 not found" in capsys.readouterr().out
    assert check_install.main(["hp-config", "--python", "3.99", "--require"]) == 1

"""The four packages of the workspace and the uv steps that build, install and test them alone.

Shared by ``scripts/release.py`` and ``tests/isolation``: one place that knows where each
package lives, what it imports as, where its tests are, and how to put its wheel into a
fresh virtual environment.

Example::

    >>> PACKAGES["hp-config"].import_names
    ('hyper_parallel.config',)
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Package:
    """One distribution of the workspace: where it lives and what it provides.

    Example::

        >>> PACKAGES["hp-dtensor"].pyproject.relative_to(ROOT).as_posix()
        'packages/dtensor/pyproject.toml'
    """

    name: str
    folder: str
    import_names: tuple[str, ...]
    tests: str

    @property
    def path(self) -> Path:
        """The package's folder, e.g. ``<root>/packages/config``."""
        return ROOT / "packages" / self.folder

    @property
    def pyproject(self) -> Path:
        """The package's own pyproject.toml."""
        return self.path / "pyproject.toml"

    @property
    def changelog(self) -> Path:
        """The package's CHANGELOG.md."""
        return self.path / "CHANGELOG.md"

    @property
    def tests_path(self) -> Path:
        """The folder of this package's tests, e.g. ``<root>/tests/config``."""
        return ROOT / self.tests

    @property
    def wheel_stem(self) -> str:
        """The distribution name as wheel files spell it (``hp_config``)."""
        return self.name.replace("-", "_")


PACKAGES: dict[str, Package] = {
    p.name: p
    for p in (
        Package("hp-config", "config", ("hyper_parallel.config",), "tests/config"),
        Package(
            "hp-platform-torch",
            "platform-torch",
            ("hyper_parallel.platform_torch",),
            "tests/platform",
        ),
        Package(
            "hp-dtensor",
            "dtensor",
            ("hyper_parallel.dtensor", "hyper_parallel.platform"),
            "tests/dtensor",
        ),
        Package("hp-dmodule", "dmodule", ("hyper_parallel.dmodule",), "tests/dmodule"),
    )
}

# Extras installed with a package when it is tested alone: dmodule needs a platform adapter.
TEST_EXTRAS: dict[str, tuple[str, ...]] = {"hp-dmodule": ("torch",)}
# What the package's tests need besides the package itself (versions pinned by uv.lock).
TEST_TOOLS: tuple[str, ...] = ("pytest", "pytest-timeout", "hypothesis")

_VERSION_LINE = re.compile(r'^version\s*=\s*"([^"]+)"\s*$', re.MULTILINE)


class StepError(RuntimeError):
    """A build, install or test step failed; the message holds the command and its output."""


def find_uv() -> str:
    """Path of the uv executable: ``$UV`` (set by ``uv run``), else the one on PATH.

    Example::

        >>> Path(find_uv()).name.startswith("uv")
        True
    """
    for candidate in (os.environ.get("UV"), shutil.which("uv")):
        if candidate and Path(candidate).exists():
            return candidate
    raise StepError(
        "uv not found: expected $UV or uv on PATH; install it: python3 -m pip install uv"
    )


def clean_env() -> dict[str, str]:
    """The environment for child processes, without the caller's virtual environment.

    Bytecode writing is switched back on: with ``PYTHONDONTWRITEBYTECODE`` set, every
    ``import torch`` in a fresh venv recompiles torch from source (about twice the CPU).

    Example::

        >>> "VIRTUAL_ENV" in clean_env()
        False
    """
    env = dict(os.environ)
    for key in (
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHOME",
        "UV_PROJECT_ENVIRONMENT",
        "PYTHONDONTWRITEBYTECODE",
    ):
        env.pop(key, None)
    return env


def run(cmd: Sequence[str | Path], *, cwd: Path = ROOT, quiet: bool = True) -> str:
    """Run ``cmd`` in ``cwd``; return its stdout, or raise StepError with its output.

    Example::

        >>> run([sys.executable, "-c", "print(6 * 7)"]).strip()
        '42'
    """
    args = [str(c) for c in cmd]
    if not quiet:
        print("+", " ".join(args), flush=True)
    proc = subprocess.run(
        args, cwd=cwd, env=clean_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-6000:]
        raise StepError(
            f"command failed with exit code {proc.returncode} (expected 0) in {cwd}:\n"
            f"  {' '.join(args)}\n{output}"
        )
    return proc.stdout


def read_version(pyproject: Path) -> str:
    """The ``[project] version`` of a package's pyproject.toml.

    Example::

        >>> read_version(PACKAGES["hp-config"].pyproject).count(".")
        2
    """
    text = pyproject.read_text(encoding="utf-8")
    project = _project_table(text, pyproject)
    match = _VERSION_LINE.search(project)
    if match is None:
        raise StepError(f"{pyproject}: expected a 'version = \"X.Y.Z\"' line in [project]")
    return match.group(1)


def write_version(pyproject: Path, version: str) -> None:
    """Set the ``[project] version`` line of ``pyproject`` to ``version`` (nothing else changes).

    Example::

        >>> write_version(PACKAGES["hp-config"].pyproject, "0.1.1")  # doctest: +SKIP
    """
    text = pyproject.read_text(encoding="utf-8")
    project = _project_table(text, pyproject)
    start = text.index(project)
    new_project, count = _VERSION_LINE.subn(f'version = "{version}"', project, count=1)
    if count != 1:
        raise StepError(f"{pyproject}: expected a 'version = \"X.Y.Z\"' line in [project]")
    pyproject.write_text(text[:start] + new_project + text[start + len(project) :], "utf-8")


def _project_table(text: str, where: Path) -> str:
    """The text of the ``[project]`` table (up to the next table header)."""
    match = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise StepError(f"{where}: expected a [project] table")
    return match.group(0)


@dataclass(frozen=True)
class Built:
    """The artifacts of one ``uv build --package``."""

    wheel: Path
    sdist: Path | None


def build(package: Package, out_dir: Path, *, workspace: Path = ROOT, sdist: bool = True) -> Built:
    """Build ``package`` alone with ``uv build --package`` into ``out_dir``.

    Example::

        >>> build(PACKAGES["hp-config"], Path("/tmp/dist")).wheel.name  # doctest: +SKIP
        'hp_config-0.1.0-py3-none-any.whl'
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd: list[str | Path] = [find_uv(), "build", "--package", package.name, "--out-dir", out_dir]
    if not sdist:
        cmd.append("--wheel")
    run(cmd, cwd=workspace)
    version = read_version(workspace / "packages" / package.folder / "pyproject.toml")
    wheel = out_dir / f"{package.wheel_stem}-{version}-py3-none-any.whl"
    tarball = out_dir / f"{package.wheel_stem}-{version}.tar.gz"
    if not wheel.is_file():
        found = sorted(p.name for p in out_dir.iterdir())
        raise StepError(f"uv build --package {package.name}: expected {wheel}, found {found}")
    if sdist and not tarball.is_file():
        raise StepError(f"uv build --package {package.name}: expected sdist {tarball}")
    return Built(wheel, tarball if sdist else None)


def wheel_files(wheel: Path) -> list[str]:
    """The paths inside a wheel archive.

    Example::

        >>> "hyper_parallel/config/py.typed" in wheel_files(Path("hp_config.whl"))  # doctest: +SKIP
        True
    """
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _dist_info_file(wheel: Path, filename: str) -> str | None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            parts = name.split("/")
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == filename:
                return archive.read(name).decode("utf-8")
    return None


def wheel_metadata(wheel: Path) -> Message:
    """The parsed ``METADATA`` of a wheel (``Requires-Dist``, ``Provides-Extra``, ...).

    Example::

        >>> wheel_metadata(Path("hp_config.whl"))["Name"]  # doctest: +SKIP
        'hp-config'
    """
    text = _dist_info_file(wheel, "METADATA")
    if text is None:
        raise StepError(f"{wheel}: expected a *.dist-info/METADATA file")
    return email.parser.Parser().parsestr(text)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of a wheel, parsed.

    Example::

        >>> [str(r) for r in wheel_requirements(Path("hp_dtensor.whl"))]  # doctest: +SKIP
        ['hp-platform-torch<0.2,>=0.1']
    """
    return [Requirement(line) for line in wheel_metadata(wheel).get_all("Requires-Dist") or []]


def wheel_entry_points(wheel: Path) -> str:
    """The raw ``entry_points.txt`` of a wheel ("" when it has none)."""
    return _dist_info_file(wheel, "entry_points.txt") or ""


def workspace_closure(package: Package, extras: Iterable[str] = ()) -> list[Package]:
    """``package`` and every workspace package it needs (with ``extras``), read from pyproject.

    Example::

        >>> [p.name for p in workspace_closure(PACKAGES["hp-dtensor"])]
        ['hp-dtensor', 'hp-platform-torch']
    """
    order: list[Package] = []
    pending: list[tuple[Package, frozenset[str]]] = [(package, frozenset(extras))]
    while pending:
        current, current_extras = pending.pop(0)
        if current in order:
            continue
        order.append(current)
        for requirement in _pyproject_requirements(current):
            if requirement.name not in PACKAGES:
                continue
            needed = requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in current_extras | {""}
            )
            if needed:
                pending.append((PACKAGES[requirement.name], frozenset(requirement.extras)))
    return order


def _pyproject_requirements(package: Package) -> list[Requirement]:
    """``dependencies`` plus optional dependencies (marked ``extra == ...``) of a package."""
    text = package.pyproject.read_text(encoding="utf-8")
    found: list[Requirement] = []
    for line in _toml_string_list(text, "dependencies"):
        found.append(Requirement(line))
    section = re.search(
        r"^\[project\.optional-dependencies\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL
    )
    if section is not None:
        for extra, body in re.findall(r"^([\w-]+)\s*=\s*\[(.*?)\]", section.group(1), re.M | re.S):
            for line in re.findall(r'"([^"]+)"', body):
                found.append(Requirement(f'{line}; extra == "{extra}"'))
    return found


def _toml_string_list(text: str, key: str) -> list[str]:
    project = _project_table(text, Path("pyproject.toml"))
    match = re.search(rf"^{key}\s*=\s*\[(.*?)\]", project, re.MULTILINE | re.DOTALL)
    return re.findall(r'"([^"]+)"', match.group(1)) if match else []


def locked_constraints(out_file: Path) -> Path:
    """Write uv.lock's third-party pins (torch, pytest, ...) as a pip constraints file.

    Installing against these pins reuses the wheels already in uv's cache (torch is ~4 GB),
    and tests the versions CI tests.

    Example::

        >>> "torch==" in locked_constraints(Path("/tmp/c.txt")).read_text()  # doctest: +SKIP
        True
    """
    text = run(
        [
            find_uv(),
            "export",
            "--frozen",
            "--no-hashes",
            "--no-header",
            "--no-annotate",
            "--no-emit-workspace",
            "--all-groups",
            "--all-extras",
        ]
    )
    out_file.write_text(text, encoding="utf-8")
    return out_file


def create_venv(path: Path) -> Path:
    """Create a fresh virtual environment at ``path`` (current Python); return its python.

    Example::

        >>> create_venv(Path("/tmp/venv")).name  # doctest: +SKIP
        'python'
    """
    run([find_uv(), "venv", "--quiet", "--python", sys.executable, path])
    python = path / "bin" / "python"
    if not python.exists():
        python = path / "Scripts" / "python.exe"
    return python


def pip_install(
    python: Path,
    requirements: Sequence[str | Path],
    *,
    constraints: Path | None = None,
    no_deps: bool = False,
    no_index: bool = False,
) -> str:
    """``uv pip install`` into the environment of ``python``; return uv's report.

    Example::

        >>> pip_install(python, ["pytest"], constraints=c)  # doctest: +SKIP
    """
    cmd: list[str | Path] = [find_uv(), "pip", "install", "--python", python]
    if constraints is not None:
        cmd += ["--constraints", constraints]
    if no_deps:
        cmd.append("--no-deps")
    if no_index:
        cmd.append("--no-index")
    return run([*cmd, *requirements])


def installed(python: Path) -> dict[str, str]:
    """Distribution name -> version of everything installed in ``python``'s environment.

    Example::

        >>> installed(python)["hp-config"]  # doctest: +SKIP
        '0.1.0'
    """
    listing = json.loads(run([find_uv(), "pip", "list", "--python", python, "--format", "json"]))
    return {str(item["name"]): str(item["version"]) for item in listing}


def install_from_wheels(
    python: Path,
    package: Package,
    wheels: dict[str, Path],
    *,
    constraints: Path,
    extras: Sequence[str] = (),
) -> None:
    """Install ``package`` from its wheel with its workspace deps from ``wheels``, the rest from PyPI.

    Workspace packages are given as wheel files (never looked up on an index by name), so a
    same-named project on PyPI cannot stand in for them; third-party pins come from uv.lock.

    Example::

        >>> install_from_wheels(python, PACKAGES["hp-dtensor"], wheels, constraints=c)  # doctest: +SKIP
    """
    closure = workspace_closure(package, extras)
    missing = [p.name for p in closure if p.name not in wheels]
    if missing:
        raise StepError(
            f"installing {package.name}: expected wheels for {missing}, found {sorted(wheels)}"
        )
    extra = f"[{','.join(extras)}]" if extras else ""
    requirements: list[str | Path] = [f"{wheels[package.name]}{extra}"]
    requirements += [wheels[p.name] for p in closure[1:]]
    pip_install(python, requirements, constraints=constraints)


def run_package_tests(python: Path, package: Package, extra_args: Sequence[str] = ()) -> str:
    """Run ``package``'s tests with ``python`` (an environment holding the installed wheel).

    pytest runs from the repository root (for the root pytest config) but, for hp-config,
    loads no conftest.py above its own test folder: hp-config's tests must not need torch.

    Example::

        >>> run_package_tests(python, PACKAGES["hp-config"])  # doctest: +SKIP
    """
    if not package.tests_path.is_dir():
        raise StepError(f"{package.name}: expected its tests in {package.tests}/, found no folder")
    cmd: list[str | Path] = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", package.tests]
    if package.name == "hp-config":
        cmd += ["--confcutdir", package.tests]
    return run([*cmd, *extra_args])

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
import time
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # requires-python is 3.10: tomllib is 3.11+
    import tomli as tomllib

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
        Package("hp-train", "train", ("hyper_parallel.train",), "tests/train"),
    )
}

# The extra of each package that names what its tests need besides the package itself
# (packages/*/pyproject.toml). The workspace's dev group, the release rehearsal and the
# isolation tests all install it: the one list of a package's test needs.
TEST_EXTRA = "test"

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


def run(
    cmd: Sequence[str | Path], *, cwd: Path = ROOT, quiet: bool = True, echo: bool = False
) -> str:
    """Run ``cmd`` in ``cwd``; return its stdout, or raise StepError with its output.

    ``echo`` streams the command's output (stdout and stderr, merged) as it comes, for
    steps that take minutes; the returned text is then that merged output.

    Example::

        >>> run([sys.executable, "-c", "print(6 * 7)"]).strip()
        '42'
    """
    args = [str(c) for c in cmd]
    if not quiet:
        print("+", " ".join(args), flush=True)
    if echo:
        returncode, output = _run_echoing(args, cwd)
        errors = ""  # merged into output
    else:
        proc = subprocess.run(
            args, cwd=cwd, env=clean_env(), capture_output=True, text=True, check=False
        )
        returncode, output, errors = proc.returncode, proc.stdout, proc.stderr
    if returncode != 0:
        raise StepError(
            f"command failed with exit code {returncode} (expected 0) in {cwd}:\n"
            f"  {' '.join(args)}\n{(output + errors)[-6000:]}"
        )
    return output


def _run_echoing(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``args``, printing each output line as it arrives; return (exit code, output)."""
    lines: list[str] = []
    with subprocess.Popen(
        args,
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return proc.returncode, "".join(lines)


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

    Extras are followed through requirements on workspace packages, self-references
    included (hp-dmodule's ``test`` extra requires ``hp-dmodule[torch,demo]``).

    Example::

        >>> [p.name for p in workspace_closure(PACKAGES["hp-dtensor"])]
        ['hp-dtensor', 'hp-platform-torch']
    """
    order: list[Package] = []
    visited: set[tuple[str, frozenset[str]]] = set()
    pending: list[tuple[Package, frozenset[str]]] = [(package, frozenset(extras))]
    while pending:
        current, current_extras = pending.pop(0)
        if (current.name, current_extras) in visited:
            continue
        visited.add((current.name, current_extras))
        if current not in order:
            order.append(current)
        for requirement in pyproject_requirements(current):
            if requirement.name in PACKAGES and any(
                _marker_holds(requirement, extra) for extra in current_extras | {""}
            ):
                pending.append((PACKAGES[requirement.name], frozenset(requirement.extras)))
    return order


def _marker_holds(requirement: Requirement, extra: str) -> bool:
    """Whether ``requirement`` applies when ``extra`` is requested ("" for none)."""
    return requirement.marker is None or requirement.marker.evaluate({"extra": extra})


def read_pyproject(path: Path) -> dict[str, Any]:
    """A pyproject.toml, parsed.

    Example::

        >>> read_pyproject(PACKAGES["hp-config"].pyproject)["project"]["name"]
        'hp-config'
    """
    with path.open("rb") as file:
        return tomllib.load(file)


def pyproject_requirements(package: Package) -> list[Requirement]:
    """``dependencies`` plus optional dependencies (marked ``extra == "NAME"``) of a package.

    Example::

        >>> [str(r) for r in pyproject_requirements(PACKAGES["hp-dtensor"])][0]
        'hp-platform-torch<0.2,>=0.1'
    """
    project: Mapping[str, Any] = read_pyproject(package.pyproject)["project"]
    found = [Requirement(line) for line in project.get("dependencies", [])]
    for extra, lines in project.get("optional-dependencies", {}).items():
        for line in lines:
            requirement = Requirement(line)
            condition = f"({requirement.marker}) and " if requirement.marker else ""
            requirement.marker = Marker(f'{condition}extra == "{extra}"')
            found.append(requirement)
    return found


def locked_constraints(out_file: Path) -> Path:
    """Write uv.lock's third-party pins (torch, pytest, ...) as a pip constraints file.

    Installing against these pins reuses the wheels already in uv's cache (torch is ~4 GB
    with its CUDA libraries), and tests the versions CI tests. The lock is universal, so
    the pins carry markers for every Python the packages declare.

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


def with_torch(constraints: Path, version: str) -> Path:
    """``constraints`` with torch pinned to ``version`` instead of uv.lock's, written beside it.

    The pins that follow torch's own requirements (its CUDA libraries, triton) are left
    free, so pip takes the ones that torch release asks for; every other pin stays.

    Example::

        >>> "torch==2.15.0" in with_torch(Path("/tmp/c.txt"), "2.15.0").read_text()  # doctest: +SKIP
        True
    """
    follows_torch = ("torch==", "triton==", "nvidia-", "cuda-")
    kept = [
        line
        for line in constraints.read_text(encoding="utf-8").splitlines()
        if not line.strip().startswith(follows_torch)
    ]
    out = constraints.with_name(f"constraints-torch-{version}.txt")
    out.write_text("\n".join([*kept, f"torch=={version}", ""]), encoding="utf-8")
    return out


def find_python(version: str) -> Path | None:
    """A CPython ``version`` (e.g. ``"3.10"``) interpreter on this machine, or None.

    Looks with ``uv python find`` (PATH, uv-managed Pythons) with downloads off — uv
    downloads Pythons from GitHub, which CI machines here cannot reach — then in pyenv's
    ``versions/`` folder, whose shims uv cannot run. Each candidate is run to check it.

    Example::

        >>> find_python("2.0") is None
        True
    """
    candidates: list[Path] = []
    try:
        found = run(
            [
                find_uv(),
                "python",
                "find",
                "--system",
                "--no-project",
                "--no-python-downloads",
                version,
            ]
        )
        candidates.append(Path(found.strip()))
    except StepError:
        pass
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    patches = sorted(
        (pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda path: _version_key(path.parents[1].name),
        reverse=True,
    )
    candidates += patches
    for candidate in candidates:
        if _is_cpython(candidate, version):
            return candidate
    return None


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in text.split("."))


def _is_cpython(python: Path, version: str) -> bool:
    """Whether ``python`` runs and is CPython ``version``."""
    check = "import platform, sys; print(platform.python_implementation(), *sys.version_info[:2])"
    try:
        found = run([python, "-c", check]).split()
    except (StepError, OSError):
        return False
    return found == ["CPython", *version.split(".")]


def python_version(python: Path) -> str:
    """The full version of the interpreter ``python`` (``3.10.13``)."""
    return run([python, "-c", "import platform; print(platform.python_version())"]).strip()


def create_venv(path: Path, interpreter: Path | str = sys.executable) -> Path:
    """Create a fresh virtual environment at ``path`` with ``interpreter``; return its python.

    Example::

        >>> create_venv(Path("/tmp/venv")).name  # doctest: +SKIP
        'python'
    """
    run([find_uv(), "venv", "--quiet", "--no-python-downloads", "--python", interpreter, path])
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
    wheels: Mapping[str, Path],
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


@dataclass(frozen=True)
class FreshInstall:
    """A fresh venv holding a package as its users install it, plus its ``test`` extra."""

    python: Path
    for_users: dict[str, str]
    """What installing the package alone (its wheel, sibling wheels, PyPI) put there."""
    for_tests: dict[str, str]
    """The same after adding the package's ``test`` extra."""

    @property
    def added_for_tests(self) -> list[str]:
        """Distributions the ``test`` extra added, e.g. ``['hypothesis', 'pytest', ...]``."""
        return sorted(self.for_tests.keys() - self.for_users.keys())


def install_fresh(
    package: Package,
    wheels: Mapping[str, Path],
    venv: Path,
    *,
    constraints: Path,
    interpreter: Path | str = sys.executable,
) -> FreshInstall:
    """Create ``venv``, install ``package`` as its users do, then its ``test`` extra.

    The test extra may bring test tools only: a sibling package that the package does not
    require (so its users would not have it) is refused, as is torch-npu.

    Example::

        >>> install_fresh(PACKAGES["hp-dtensor"], wheels, Path("/tmp/v"), constraints=c)  # doctest: +SKIP
        FreshInstall(python=PosixPath('/tmp/v/bin/python'), ...)
    """
    python = create_venv(venv, interpreter)
    install_from_wheels(python, package, wheels, constraints=constraints)
    for_users = installed(python)
    install_from_wheels(python, package, wheels, constraints=constraints, extras=(TEST_EXTRA,))
    fresh = FreshInstall(python, for_users, installed(python))
    siblings = [name for name in fresh.added_for_tests if name in PACKAGES]
    if siblings:
        raise StepError(
            f"{package.name}[{TEST_EXTRA}] installs {siblings}, which {package.name}'s users do "
            f"not get: its tests must not need them (move those tests to {siblings}'s own), or "
            f"{package.name} must require them"
        )
    if "torch-npu" in fresh.for_tests:
        raise StepError("fresh venv: torch-npu was installed; it must only come with the npu extra")
    expected = wheel_metadata(wheels[package.name])["Version"]
    if fresh.for_users.get(package.name) != expected:
        raise StepError(
            f"fresh venv: expected {package.name}=={expected} (from "
            f"{wheels[package.name].name}), found {fresh.for_users.get(package.name)}"
        )
    return fresh


def run_package_tests(
    python: Path, package: Package, pytest_args: Sequence[str] = (), *, echo: bool = False
) -> str:
    """Run ``package``'s tests (or ``pytest_args``) with ``python``; return pytest's output.

    ``python`` is an environment holding the installed wheel. pytest runs from the
    repository root (for the root pytest config) but, for hp-config, loads no conftest.py
    above its own test folder: hp-config's tests must not need torch.

    Example::

        >>> run_package_tests(python, PACKAGES["hp-config"])  # doctest: +SKIP
    """
    if not package.tests_path.is_dir():
        raise StepError(f"{package.name}: expected its tests in {package.tests}/, found no folder")
    cmd: list[str | Path] = [python, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider"]
    if package.name == "hp-config":
        cmd += ["--confcutdir", package.tests]
    return run([*cmd, *(pytest_args or [package.tests])], echo=echo)


def run_demo(python: Path, steps: int, work: Path) -> str:
    """Run the README's demo (``--steps steps``) with ``python``, in ``work``; return its output.

    Example::

        >>> run_demo(python, 3, Path("/tmp/demo")).splitlines()[-1]  # doctest: +SKIP
        'loss curve: ...; median step 9.1 ms; total 4.2 s'
    """
    work.mkdir(parents=True, exist_ok=True)
    plot = work / "loss_curve.png"
    cmd: list[str | Path] = [
        python,
        "-m",
        "hyper_parallel.dmodule.demo",
        "--steps",
        str(steps),
        "--plot",
        plot,
    ]
    return run(cmd, cwd=work)


def last_line(output: str) -> str:
    """The last non-empty line of a command's output (pytest's and the demo's summary)."""
    lines = output.strip().splitlines()
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Rehearsal:
    """What :func:`build_install_test` built, installed and ran."""

    built: Built
    install: FreshInstall
    python_version: str
    tests: str
    """pytest's summary line, or "" when no tests were asked for."""


def build_install_test(
    package: Package,
    work: Path,
    *,
    workspace: Path = ROOT,
    interpreter: Path | str = sys.executable,
    pytest_args: Sequence[str] | None = (),
    torch_version: str | None = None,
) -> Rehearsal:
    """Build ``package`` alone, install it into a fresh venv as its users do, and test it there.

    1. ``uv build --package NAME`` (sdist + wheel) from ``workspace``, and wheels of the
       workspace packages it requires;
    2. a fresh venv with ``interpreter``; ``pip install`` the wheel with those sibling wheels
       and third-party requirements from PyPI at uv.lock's versions (what its users get),
       then the same with its ``test`` extra (which may add test tools only);
    3. ``pytest`` on the package's tests (``tests/<name>``), or on ``pytest_args``; none when
       ``pytest_args`` is None.

    ``torch_version`` installs that torch instead of uv.lock's (an end of the declared range).

    Example::

        >>> build_install_test(PACKAGES["hp-config"], Path("/tmp/w")).tests  # doctest: +SKIP
        '176 passed in 5.01s'
    """
    version = read_version(workspace / "packages" / package.folder / "pyproject.toml")
    _say(f"== build {package.name} {version} (uv build --package {package.name})")
    started = time.monotonic()
    built = build(package, work / "dist", workspace=workspace)
    assert built.sdist is not None
    wheels = {package.name: built.wheel}
    for dependency in workspace_closure(package, (TEST_EXTRA,))[1:]:
        wheels[dependency.name] = build(
            dependency, work / "deps", workspace=workspace, sdist=False
        ).wheel
    _say(
        f"  built {built.wheel.name}, {built.sdist.name}; siblings: {_names(wheels, package)}"
        f" ({_since(started)})"
    )

    full_version = python_version(Path(interpreter))
    _say(f"== install into a fresh venv (CPython {full_version})")
    started = time.monotonic()
    constraints = locked_constraints(work / "constraints.txt")
    if torch_version is not None:
        constraints = with_torch(constraints, torch_version)
    fresh = install_fresh(
        package, wheels, work / "venv", constraints=constraints, interpreter=interpreter
    )
    if torch_version is not None and fresh.for_tests.get("torch") != torch_version:
        raise StepError(
            f"fresh venv: expected torch=={torch_version}, found {fresh.for_tests.get('torch')}"
        )
    _say(
        f"  {package.name} as users install it: {_count(fresh.for_users)}; "
        f"its [{TEST_EXTRA}] extra added {', '.join(fresh.added_for_tests) or 'nothing'}"
        f" ({_since(started)})"
    )
    summary = ""
    if pytest_args is not None:
        args = list(pytest_args) or [package.tests]
        _say(f"== pytest {' '.join(args)} (in that venv)")
        started = time.monotonic()
        summary = last_line(run_package_tests(fresh.python, package, args, echo=True))
        _say(f"  {summary} ({_since(started)})")
    return Rehearsal(built, fresh, full_version, summary)


def _say(text: str) -> None:
    print(text, flush=True)


def _count(distributions: Mapping[str, str]) -> str:
    return f"{len(distributions)} distribution{'' if len(distributions) == 1 else 's'}"


def _since(started: float) -> str:
    return f"{time.monotonic() - started:.1f} s"


def _names(wheels: Mapping[str, Path], package: Package) -> str:
    others = [name for name in wheels if name != package.name]
    return ", ".join(others) or "none"

"""Release one package of the workspace alone: bump, build, install the wheel fresh, test.

Usage::

    uv run python scripts/release.py hp-config 0.1.1 [--dry-run] [--allow-dirty] [--python 3.10]
    uv run python scripts/release.py --check-builds

Steps, all before the working tree is touched:

1. validate: known package, ``X.Y.Z`` version (PEP 440 pre-releases ``0.2.0rc1`` allowed)
   greater than the current one, a ``## X.Y.Z`` entry in the package's CHANGELOG.md, and
   no uncommitted changes in the package (unless ``--allow-dirty``);
2. copy the workspace's ``packages/`` into a staging folder and bump the version there;
3. ``uv build --package NAME`` (sdist + wheel), plus wheels of the workspace packages it
   requires;
4. create a fresh venv (the running Python, or ``--python``), install the wheel as its
   users do: with the sibling wheels it requires and third-party requirements such as
   torch from PyPI at the versions pinned in uv.lock; then add its ``test`` extra (test
   tools only: a sibling that users would not get is refused);
5. run the package's tests (``tests/<name>``) with that venv's python.

Then, unless ``--dry-run``: write the new version into ``packages/NAME/pyproject.toml``,
refresh uv.lock, and copy the sdist and wheel to ``dist/NAME/``. Publishing and tagging
are left to the person releasing (the commands are printed).

``--check-builds`` only checks that ``uv build --package`` works for all five packages.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hp_workspace import (
    PACKAGES,
    ROOT,
    Package,
    Rehearsal,
    StepError,
    build,
    build_install_test,
    find_python,
    find_uv,
    read_version,
    run,
    write_version,
)

_RELEASE_VERSION = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)((a|b|rc)(0|[1-9]\d*))?$")


def validate_version(package: Package, new_version: str) -> Version:
    """Check ``new_version`` is ``X.Y.Z`` (optionally ``aN``/``bN``/``rcN``) above the current one.

    Example::

        >>> validate_version(PACKAGES["hp-config"], "99.0.0")
        <Version('99.0.0')>
    """
    if _RELEASE_VERSION.match(new_version) is None:
        raise StepError(
            f"{package.name}: version {new_version!r} is not MAJOR.MINOR.PATCH "
            "(e.g. 0.1.1; pre-releases as 0.2.0rc1)"
        )
    current = read_version(package.pyproject)
    try:
        current_version = Version(current)
    except InvalidVersion as error:
        raise StepError(f"{package.pyproject}: current version {current!r} is invalid") from error
    new = Version(new_version)
    if new <= current_version:
        raise StepError(
            f"{package.name}: new version {new_version} must be greater than the current "
            f"version {current} (in {package.pyproject.relative_to(ROOT)})"
        )
    return new


def check_changelog(package: Package, new_version: str) -> None:
    """Require a ``## <new_version>`` heading in the package's CHANGELOG.md.

    Example::

        >>> check_changelog(PACKAGES["hp-config"], "0.1.0")
    """
    path = package.changelog
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    heading = re.compile(rf"^##\s+\[?{re.escape(new_version)}\]?(\s|$)", re.MULTILINE)
    if heading.search(text) is None:
        raise StepError(
            f"{path.relative_to(ROOT)} has no entry for {new_version}: expected a heading "
            f"'## {new_version}' followed by what changed; add it, commit it, then release"
        )


def check_clean(package: Package) -> None:
    """Refuse when git reports uncommitted changes under the package's folder.

    Example::

        >>> check_clean(PACKAGES["hp-config"])  # doctest: +SKIP
    """
    try:
        status = run(["git", "status", "--porcelain", "--", package.path])
    except (StepError, FileNotFoundError) as error:
        raise StepError(f"cannot read git status of {package.path}: {error}") from error
    if status.strip():
        raise StepError(
            f"{package.path.relative_to(ROOT)} has uncommitted changes (commit them first, "
            f"or pass --allow-dirty):\n{status.rstrip()}"
        )


def warn_about_dependents(package: Package, new: Version) -> None:
    """Say which workspace packages' requirement ranges exclude the new version."""
    for other in PACKAGES.values():
        text = other.pyproject.read_text(encoding="utf-8")
        for spec in re.findall(rf'"{re.escape(package.name)}([^";\[]*)', text):
            if spec.strip() and new not in SpecifierSet(spec.strip()):
                print(
                    f"note: {other.name} requires {package.name}{spec}, which excludes {new}; "
                    f"release {other.name} with a widened range to use it",
                    flush=True,
                )


def stage_workspace(staging: Path) -> Path:
    """Copy the workspace's build inputs (root pyproject, packages/) to ``staging``."""
    staging.mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", staging / "pyproject.toml")
    shutil.copytree(
        ROOT / "packages",
        staging / "packages",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "dist", "build", "*.egg-info"),
    )
    return staging


def rehearse(
    package: Package,
    new_version: str,
    work: Path,
    *,
    interpreter: Path | str = sys.executable,
    pytest_args: Sequence[str] = (),
) -> Rehearsal:
    """Bump in a staged copy, build, install into a fresh venv and test there.

    ``pytest_args`` narrows the tests (default: the package's whole test folder).

    Example::

        >>> rehearse(PACKAGES["hp-config"], "0.1.1", Path("/tmp/r")).tests  # doctest: +SKIP
        '176 passed in 5.01s'
    """
    staging = stage_workspace(work / "workspace")
    write_version(staging / "packages" / package.folder / "pyproject.toml", new_version)
    return build_install_test(
        package, work, workspace=staging, interpreter=interpreter, pytest_args=pytest_args
    )


def release(
    package: Package,
    new_version: str,
    *,
    dry_run: bool,
    allow_dirty: bool,
    interpreter: Path | str = sys.executable,
) -> None:
    """Validate, rehearse in a staging copy, then (unless dry-run) bump and keep the artifacts."""
    step(f"validate {package.name} {read_version(package.pyproject)} -> {new_version}")
    new = validate_version(package, new_version)
    check_changelog(package, new_version)
    if not allow_dirty:
        check_clean(package)
    warn_about_dependents(package, new)

    with tempfile.TemporaryDirectory(prefix=f"release-{package.name}-") as tmp:
        built = rehearse(package, new_version, Path(tmp), interpreter=interpreter).built
        assert built.sdist is not None
        if dry_run:
            print(
                f"\ndry run: {package.name} {new_version} builds and passes its tests; "
                "nothing was changed",
                flush=True,
            )
            return
        step("write the new version and keep the artifacts")
        write_version(package.pyproject, new_version)
        run([find_uv(), "lock"])
        dist = ROOT / "dist" / package.name
        dist.mkdir(parents=True, exist_ok=True)
        for artifact in (built.wheel, built.sdist):
            shutil.copy2(artifact, dist / artifact.name)
    tag = f"{package.name}-v{new_version}"
    print(
        f"\n{package.name} {new_version} is ready in dist/{package.name}/. Next:\n"
        f"  git commit -am 'Release {package.name} {new_version}' && git tag {tag}\n"
        f"  uv publish dist/{package.name}/*{new_version}*",
        flush=True,
    )


def check_builds() -> None:
    """Check ``uv build --package`` builds an sdist and a wheel for each of the five packages."""
    with tempfile.TemporaryDirectory(prefix="hp-build-check-") as tmp:
        for package in PACKAGES.values():
            built = build(package, Path(tmp) / package.name)
            print(f"  {package.name}: {built.wheel.name}", flush=True)


def step(title: str) -> None:
    """Print a step header."""
    print(f"== {title}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("package", nargs="?", choices=sorted(PACKAGES), help="distribution name")
    parser.add_argument("version", nargs="?", help="new version, e.g. 0.1.1")
    parser.add_argument("--dry-run", action="store_true", help="rehearse only; change nothing")
    parser.add_argument(
        "--allow-dirty", action="store_true", help="release with uncommitted changes"
    )
    parser.add_argument(
        "--python",
        metavar="VERSION",
        help="CPython to rehearse on, e.g. 3.10 (default: the one running this script)",
    )
    parser.add_argument("--check-builds", action="store_true", help="only build all five packages")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.check_builds:
            check_builds()
        elif args.package is None or args.version is None:
            parser.error("expected PACKAGE and VERSION (or --check-builds)")
        else:
            interpreter = find_python(args.python) if args.python else Path(sys.executable)
            if interpreter is None:
                raise StepError(
                    f"--python {args.python}: no CPython {args.python} found (looked with "
                    "`uv python find` and in pyenv's versions folder)"
                )
            release(
                PACKAGES[args.package],
                args.version,
                dry_run=args.dry_run,
                allow_dirty=args.allow_dirty,
                interpreter=interpreter,
            )
    except (StepError, OSError, subprocess.SubprocessError) as error:
        print(f"release failed: {error}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Release one package of the workspace alone: bump, build, install the wheel fresh, test.

Usage::

    uv run python scripts/release.py hp-config 0.1.1 [--dry-run] [--allow-dirty]
    uv run python scripts/release.py --check-builds

Steps, all before the working tree is touched:

1. validate: known package, ``X.Y.Z`` version (PEP 440 pre-releases ``0.2.0rc1`` allowed)
   greater than the current one, a ``## X.Y.Z`` entry in the package's CHANGELOG.md, and
   no uncommitted changes in the package (unless ``--allow-dirty``);
2. copy the workspace's ``packages/`` into a staging folder and bump the version there;
3. ``uv build --package NAME`` (sdist + wheel), plus wheels of the workspace packages it
   depends on;
4. create a fresh venv, install the wheel (hp-config: alone, without dependencies; the
   others: with their workspace deps from the fresh local wheels and third-party deps
   such as torch from PyPI at the versions pinned in uv.lock);
5. run the package's tests (``tests/<name>``) with that venv's python.

Then, unless ``--dry-run``: write the new version into ``packages/NAME/pyproject.toml``,
refresh uv.lock, and copy the sdist and wheel to ``dist/NAME/``. Publishing and tagging
are left to the person releasing (the commands are printed).

``--check-builds`` only checks that ``uv build --package`` works for all four packages.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from hp_workspace import (
    PACKAGES,
    ROOT,
    TEST_EXTRAS,
    TEST_TOOLS,
    Package,
    StepError,
    build,
    create_venv,
    find_uv,
    install_from_wheels,
    installed,
    locked_constraints,
    pip_install,
    read_version,
    run,
    run_package_tests,
    workspace_closure,
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


def rehearse(package: Package, new_version: str, work: Path) -> tuple[Path, Path]:
    """Bump in a staged copy, build, install into a fresh venv and test; return (wheel, sdist)."""
    staging = stage_workspace(work / "workspace")
    write_version(staging / "packages" / package.folder / "pyproject.toml", new_version)
    extras = TEST_EXTRAS.get(package.name, ())

    step(f"build {package.name} {new_version} (uv build --package {package.name})")
    out = work / "dist"
    built = build(package, out, workspace=staging)
    assert built.sdist is not None
    wheels = {package.name: built.wheel}
    for dependency in workspace_closure(package, extras)[1:]:
        wheels[dependency.name] = build(
            dependency, work / "deps", workspace=staging, sdist=False
        ).wheel
    print(f"  built {built.wheel.name}, {built.sdist.name}", flush=True)

    step("install the wheel into a fresh venv")
    python = create_venv(work / "venv")
    constraints = locked_constraints(work / "constraints.txt")
    if package.name == "hp-config":
        pip_install(python, [built.wheel], no_deps=True)
    else:
        install_from_wheels(python, package, wheels, constraints=constraints, extras=extras)
    versions = installed(python)
    if versions.get(package.name) != new_version:
        raise StepError(
            f"fresh venv: expected {package.name}=={new_version}, found {versions.get(package.name)}"
        )
    if "torch-npu" in versions:
        raise StepError("fresh venv: torch-npu was installed; it must only come with the npu extra")
    print(f"  {len(versions)} distributions installed", flush=True)

    step(f"run {package.tests}/ in that venv")
    pip_install(python, list(TEST_TOOLS), constraints=constraints)
    print(run_package_tests(python, package).rstrip().splitlines()[-1], flush=True)
    return built.wheel, built.sdist


def release(package: Package, new_version: str, *, dry_run: bool, allow_dirty: bool) -> None:
    """Validate, rehearse in a staging copy, then (unless dry-run) bump and keep the artifacts."""
    step(f"validate {package.name} {read_version(package.pyproject)} -> {new_version}")
    new = validate_version(package, new_version)
    check_changelog(package, new_version)
    if not allow_dirty:
        check_clean(package)
    warn_about_dependents(package, new)

    with tempfile.TemporaryDirectory(prefix=f"release-{package.name}-") as tmp:
        wheel, sdist = rehearse(package, new_version, Path(tmp))
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
        for artifact in (wheel, sdist):
            shutil.copy2(artifact, dist / artifact.name)
    tag = f"{package.name}-v{new_version}"
    print(
        f"\n{package.name} {new_version} is ready in dist/{package.name}/. Next:\n"
        f"  git commit -am 'Release {package.name} {new_version}' && git tag {tag}\n"
        f"  uv publish dist/{package.name}/*{new_version}*",
        flush=True,
    )


def check_builds() -> None:
    """Check ``uv build --package`` builds an sdist and a wheel for each of the four packages."""
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
    parser.add_argument("--check-builds", action="store_true", help="only build all four packages")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.check_builds:
            check_builds()
        elif args.package is None or args.version is None:
            parser.error("expected PACKAGE and VERSION (or --check-builds)")
        else:
            release(
                PACKAGES[args.package],
                args.version,
                dry_run=args.dry_run,
                allow_dirty=args.allow_dirty,
            )
    except (StepError, OSError, subprocess.SubprocessError) as error:
        print(f"release failed: {error}", file=sys.stderr)
        return 1
    print(f"done in {time.monotonic() - started:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

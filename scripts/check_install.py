"""Build one package, install it into a fresh venv on each given CPython, and test it there.

Usage::

    uv run --frozen python scripts/check_install.py hp-config --python 3.10 --python 3.13
    uv run --frozen python scripts/check_install.py hp-dmodule --python 3.10 --demo-steps 3 \\
        --no-tests
    uv run --frozen python scripts/check_install.py hp-dtensor -- tests/dtensor/test_placements.py
    uv run --frozen python scripts/check_install.py hp-dmodule --torch 2.15.0 -- tests/dtensor

The same path as the release rehearsal (``scripts/release.py NAME X.Y.Z --dry-run``), for
the version in the working tree: ``uv build --package NAME`` (and its sibling wheels), a
fresh venv, the wheel installed as its users install it plus its ``test`` extra, then
pytest on its tests (``tests/<name>``, or the arguments after ``--``) with that venv's
Python; ``--demo-steps N`` also runs the README's demo for N steps there. ``--torch VERSION``
installs that torch from PyPI instead of uv.lock's (to test an end of the declared range).

Each ``--python VERSION`` is looked up with ``uv python find`` and in pyenv's versions
folder, never downloaded (uv downloads Pythons from GitHub). One that this machine does
not have is skipped with a printed NOTICE (an error with ``--require``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hp_workspace import PACKAGES, StepError, build_install_test, find_python, last_line, run_demo


def check(
    name: str,
    version: str | None,
    *,
    pytest_args: list[str] | None,
    demo_steps: int,
    torch_version: str | None = None,
) -> str:
    """Run the build → fresh venv → install → test path once; return a one-line result."""
    interpreter = find_python(version) if version else Path(sys.executable)
    if interpreter is None:
        raise LookupError(version)
    with tempfile.TemporaryDirectory(prefix=f"check-install-{name}-") as tmp:
        done = build_install_test(
            PACKAGES[name],
            Path(tmp),
            interpreter=interpreter,
            pytest_args=pytest_args,
            torch_version=torch_version,
        )
        result = done.tests
        if demo_steps:
            print(f"== demo --steps {demo_steps} (in that venv)", flush=True)
            demo = run_demo(done.install.python, demo_steps, Path(tmp) / "demo")
            print(demo.rstrip(), flush=True)
            verdict = [line for line in demo.splitlines() if line.startswith("max |delta loss|")]
            demo_result = f"demo --steps {demo_steps}: {(verdict or [last_line(demo)])[0]}"
            result = "; ".join(filter(None, [result, demo_result]))
    on_torch = f", torch {torch_version}" if torch_version else ""
    return f"{name} on CPython {done.python_version}{on_torch}: {result or 'installed'}"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    args_list = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in args_list:
        split = args_list.index("--")
        args_list, pytest_args = args_list[:split], args_list[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("package", choices=sorted(PACKAGES), help="distribution name")
    parser.add_argument(
        "--python",
        metavar="VERSION",
        action="append",
        help="CPython to check on, e.g. 3.10; repeatable (default: the one running this)",
    )
    parser.add_argument("--demo-steps", type=int, default=0, help="also run the demo N steps")
    parser.add_argument(
        "--torch",
        metavar="VERSION",
        help="install this torch from PyPI instead of uv.lock's, e.g. 2.15.0",
    )
    parser.add_argument("--no-tests", action="store_true", help="run no tests (with the demo)")
    parser.add_argument(
        "--require", action="store_true", help="fail, not skip, when a --python is absent"
    )
    args = parser.parse_args(args_list)
    if args.no_tests and pytest_args:
        parser.error("--no-tests and test arguments after -- exclude each other")
    results: list[str] = []
    status = 0
    for version in args.python or [None]:
        started = time.monotonic()
        try:
            line = check(
                args.package,
                version,
                pytest_args=None if args.no_tests else pytest_args,
                demo_steps=args.demo_steps,
                torch_version=args.torch,
            )
        except LookupError:
            line = (
                f"NOTICE: CPython {version} not found on this machine (looked with `uv python "
                f"find` and in pyenv's versions folder); {args.package} NOT checked on {version}"
            )
            if args.require:
                status = 1
        except StepError as error:
            print(f"check failed: {error}", file=sys.stderr, flush=True)
            line, status = f"FAILED: {args.package} on CPython {version or 'current'}", 1
        results.append(f"{line} [{time.monotonic() - started:.0f}s]")
        print(results[-1], flush=True)
    print("\n".join(["", "== summary", *results]), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Fixtures for the isolation tests: each package's wheel, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from hp_workspace import PACKAGES, Built, build, locked_constraints


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """Sdist and wheel of each package, from ``uv build --package NAME`` (once per session)."""
    out = tmp_path_factory.mktemp("dist")
    return {name: build(package, out / name) for name, package in PACKAGES.items()}


@pytest.fixture(scope="session")
def wheels(built: dict[str, Built]) -> dict[str, Path]:
    """Distribution name -> its freshly built wheel."""
    return {name: artifacts.wheel for name, artifacts in built.items()}


@pytest.fixture(scope="session")
def constraints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """uv.lock's third-party pins as a constraints file (torch then comes from uv's cache)."""
    return locked_constraints(tmp_path_factory.mktemp("lock") / "constraints.txt")

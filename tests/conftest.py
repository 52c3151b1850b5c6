"""Pytest setup shared by every test folder.

Makes the repository root importable so that test modules can write
``from tests._harness import run_on_ranks``, and so that the rank processes the
harness starts (which inherit this ``sys.path``) can import the test module that
defines the function they run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Every test runs in hp-dtensor's strict mode: an op that would take the gather fallback
# raises instead (a missing or declining sharding rule shows up as a failure). A test that
# expects a fallback says so with ``@pytest.mark.allows_fallback``; the rank processes the
# harness starts inherit the environment, so the mark reaches them too.
os.environ["HYPER_PARALLEL_STRICT"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allows_fallback: the test expects an op to take hp-dtensor's gather fallback"
    )


@pytest.fixture(autouse=True)
def _strict_fallbacks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("allows_fallback") is not None:
        monkeypatch.setenv("HYPER_PARALLEL_STRICT", "0")

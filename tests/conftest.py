"""Pytest setup shared by every test folder.

Makes the repository root importable so that test modules can write
``from tests._harness import run_on_ranks``, and so that the rank processes the
harness starts (which inherit this ``sys.path``) can import the test module that
defines the function they run.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

"""Make the repository's ``bench`` folder importable (``bench.common...``) in these tests and,
through the forkserver's copy of ``sys.path``, in the ranks they start; import the bench's
heavy modules once in that forkserver."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(scope="session", autouse=True)
def _preloaded_forkserver() -> None:
    from bench.common.runner import preload_rank_imports

    preload_rank_imports(["bench.baselines.megatron", "bench.baselines.torch_tp"])

"""``bench/bench_checkpoint.py`` end to end on a one-layer model, 2 ranks."""

from __future__ import annotations

import math
from pathlib import Path

from bench import bench_checkpoint


def test_bench_checkpoint_runs_and_reports_every_ratio(tmp_path: Path) -> None:
    ratios = bench_checkpoint.main(["--layers", "1", "--reps", "1", "--dir", str(tmp_path)])
    assert set(ratios) == {
        "save_s",
        "load_s",
        "save_min_s",
        "load_min_s",
        "save_b",
        "load_b",
        "load_hf",
    }
    assert all(math.isfinite(r) and r > 0 for k, r in ratios.items() if k.endswith("_s"))
    assert 0.9 < ratios["load_hf"] < 2.0  # the rank's shards plus one tensor's slice at a time

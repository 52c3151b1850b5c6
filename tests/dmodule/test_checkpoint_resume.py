"""Resume is exact: the same mesh gives bitwise the same run; another mesh the same within reordering.

Also: a checkpoint is committed atomically (a crash mid-save leaves the previous
one loadable), an incompatible model is named before anything is modified, and
``async_save`` saves the same checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests.dmodule._checkpoint_training import CONFIG, app_state, build, full_params, train

from hyper_parallel.dmodule.checkpoint import (
    MANIFEST,
    CheckpointCorruptError,
    CheckpointMismatchError,
    PendingSave,
    TrainingState,
    latest_step,
    load,
    read_manifest,
    save,
)
from hyper_parallel.platform_torch.launch import DistributedRunError

K, N = 2, 2


def _reference_run(directory: str, dp: int, tp: int, async_save: bool) -> dict[str, Any]:
    """Train K steps, save, train N more."""
    mesh, model, opt = build(dp, tp, seed=0)
    state = TrainingState()
    torch.manual_seed(11)
    train(mesh, model, opt, state, K)
    rng_at_save = torch.get_rng_state()
    random.seed(5)
    python_rng = random.getstate()
    state.extra["note"] = [1.5, "k steps"]
    saved = save(app_state(model, opt, state), directory, step=state.step, async_save=async_save)
    if isinstance(saved, PendingSave):
        saved.wait()
    losses = train(mesh, model, opt, state, N)
    return {
        "rng": rng_at_save,
        "python_rng": python_rng,
        "losses": losses,
        "params": full_params(model),
    }


def _resumed_run(directory: str, dp: int, tp: int) -> dict[str, Any]:
    """A fresh process group: build with other values, load the latest, train N steps."""
    mesh, model, opt = build(dp, tp, seed=1)
    state = TrainingState()
    torch.manual_seed(99)  # another RNG state: the load must restore the saved one
    random.seed(98)
    step = load(app_state(model, opt, state), directory)
    restored = {
        "step": (step, state.step, state.data_position),
        "rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "extra": state.extra,
    }
    losses = train(mesh, model, opt, state, N)
    return {**restored, "losses": losses, "params": full_params(model)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_on_the_same_mesh_is_bitwise(tmp_path: Path, async_save: bool) -> None:
    ref = run_on_ranks(_reference_run, 2, str(tmp_path), 1, 2, async_save)
    # committed with a manifest of every file, asynchronous saves too
    manifest = read_manifest(tmp_path / f"step-{K}")
    on_disk = {p.name for p in (tmp_path / f"step-{K}").iterdir()} - {MANIFEST}
    assert manifest is not None and set(manifest["files"]) == on_disk, on_disk
    assert {"__0_0.distcp", "__1_0.distcp"} <= on_disk  # both ranks' shards
    resumed = run_on_ranks(_resumed_run, 2, str(tmp_path), 1, 2)
    for want, got in zip(ref, resumed, strict=True):
        assert got["step"] == (K, K, K)
        assert got["extra"] == {"note": [1.5, "k steps"]}
        assert torch.equal(got["rng"], want["rng"])
        assert got["python_rng"] == want["python_rng"]
        assert got["losses"] == want["losses"]
        for key, value in want["params"].items():
            assert torch.equal(got["params"][key], value), key
    if not async_save:  # onto more ranks: ranks 2 and 3 saved no RNG state and take rank 0's
        for got in run_on_ranks(_resumed_run, 4, str(tmp_path), 2, 2):
            assert torch.equal(got["rng"], ref[0]["rng"])
            assert got["python_rng"] == ref[0]["python_rng"]


def test_resume_on_another_mesh_continues_the_run(tmp_path: Path) -> None:
    ref = run_on_ranks(_reference_run, 4, str(tmp_path), 2, 2, False)[0]
    for world, dp, tp in [(4, 1, 4), (2, 2, 1)]:
        for got in run_on_ranks(_resumed_run, world, str(tmp_path), dp, tp):
            assert got["step"] == (K, K, K)
            assert torch.equal(got["rng"], ref["rng"])
            for g, w in zip(got["losses"], ref["losses"], strict=True):
                assert abs(g - w) <= 1e-4 * abs(w), (dp, tp, got["losses"], ref["losses"])


# -- safety ------------------------------------------------------------------------


class _CrashWhenWritten:
    """Pickled (by DCP's writer) only on the rank that holds it: that rank dies mid-save."""

    def __reduce__(self) -> Any:
        os._exit(17)


def _save_then_crash(directory: str) -> None:
    mesh, model, opt = build(1, 2, seed=0)
    state = TrainingState()
    torch.manual_seed(11)
    train(mesh, model, opt, state, 1)
    save(app_state(model, opt, state), directory, step=state.step)
    train(mesh, model, opt, state, 1)
    app = app_state(model, opt, state)
    if torch.distributed.get_rank() == 1:
        app["crash"] = _CrashWhenWritten()
    save(app, directory, step=state.step)


def _first_checkpoint_params(directory: str) -> dict[str, Any]:
    mesh, model, opt = build(1, 2, seed=0)
    state = TrainingState()
    torch.manual_seed(11)
    train(mesh, model, opt, state, 1)
    expected = full_params(model)
    _, model, opt = build(1, 2, seed=1)
    state = TrainingState()
    step = load(app_state(model, opt, state), directory)
    got = full_params(model)
    return {"step": step, "equal": all(torch.equal(got[k], v) for k, v in expected.items())}


def test_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    with pytest.raises(DistributedRunError):
        run_on_ranks(_save_then_crash, 2, str(tmp_path), timeout_s=60)
    assert (tmp_path / ".step-2.partial").is_dir()  # the save that died, never committed
    assert not (tmp_path / "step-2").exists()
    assert latest_step(tmp_path) == 1
    for found in run_on_ranks(_first_checkpoint_params, 2, str(tmp_path)):
        assert found == {"step": 1, "equal": True}


def _save_small(directory: str) -> None:
    _, model, opt = build(1, 2, seed=0)
    save(app_state(model, opt, TrainingState()), directory, step=0)


def _load_incompatible(directory: str) -> dict[str, Any]:
    # one layer more (missing keys), ffn 32 instead of 24 (mis-shaped), no output norm ...
    config = CONFIG.replace(n_layers=3, ffn_dim=32)
    _, model, _ = build(1, 2, seed=1, config=config)
    del model.norm  # ... and one module fewer: the checkpoint's norm keys are unexpected
    model.norm = torch.nn.Identity()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = full_params(model)
    try:
        load(app_state(model, opt, TrainingState()), directory)
    except CheckpointMismatchError as error:
        after = full_params(model)
        found: dict[str, Any] = {
            "message": str(error),
            "missing": error.missing,
            "unexpected": error.unexpected,
            "mis_shaped": error.mis_shaped,
            "unchanged": all(torch.equal(after[k], v) for k, v in before.items()),
        }
    else:
        return {}
    # the ranks hash the files in turns (file i by rank i % 2): damage one that rank 1 hashes
    checkpoint = Path(directory) / "step-0"
    order = sorted(p.name for p in checkpoint.iterdir() if p.name != MANIFEST)
    found["damaged"] = order[1]
    torch.distributed.barrier()  # every rank has listed the files
    if torch.distributed.get_rank() == 0:
        data = bytearray((checkpoint / order[1]).read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only its SHA-256 tells
        (checkpoint / order[1]).write_bytes(bytes(data))
    torch.distributed.barrier()
    try:
        load(app_state(model, opt, TrainingState()), directory)
    except CheckpointCorruptError as error:
        found["corrupt"] = (error.file, str(error))
    return found


def test_loading_an_incompatible_model_names_every_bad_key_and_modifies_nothing(
    tmp_path: Path,
) -> None:
    run_on_ranks(_save_small, 2, str(tmp_path))
    results = run_on_ranks(_load_incompatible, 2, str(tmp_path))
    for found in results:
        assert found, "no CheckpointMismatchError"
        assert found["unchanged"]
        assert "app.model.layers.2.attention.wq.weight" in found["missing"]
        assert "app.model.norm.weight" in found["unexpected"]
        assert found["mis_shaped"]["app.model.layers.0.feed_forward.w1.weight"] == (
            (24, 16),
            (32, 16),
        )
        assert "nothing was modified" in found["message"]
    # a changed file is named on every rank, whichever rank hashed it
    (rank0, rank1) = (found["corrupt"] for found in results)
    assert rank0[0] == rank1[0] == results[0]["damaged"], (rank0, rank1)
    assert "SHA-256" in rank0[1] and "SHA-256" in rank1[1] and "nothing was read" in rank0[1]

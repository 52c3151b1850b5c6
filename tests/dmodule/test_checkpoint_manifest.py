"""Each checkpoint carries a manifest of its files; a damaged one is refused before it is read.

Oracles: hashlib over the files on disk; the parameters of a model that loaded nothing;
a planted pickle that leaves a marker file when it is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.dmodule._checkpoint_training import app_state, build, full_params, train

from hyper_parallel.dmodule.checkpoint import (
    MANIFEST,
    CheckpointCorruptError,
    TrainingState,
    UnverifiedCheckpointWarning,
    load,
    read_manifest,
    save,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Steps 1 and 2 of a one-process run; the parameters saved at step 2."""
    root = tmp_path_factory.mktemp("saved")
    mesh, model, opt = build(1, 0, seed=0)
    state = TrainingState()
    torch.manual_seed(3)
    for _ in range(2):
        train(mesh, model, opt, state, 1)
        save(app_state(model, opt, state), root, step=state.step, info={"seed": 3})
    return root, full_params(model)


def _copy(saved: tuple[Path, dict[str, torch.Tensor]], to: Path) -> dict[str, torch.Tensor]:
    """A copy of the saved checkpoints in ``to`` (each test damages its own)."""
    shutil.copytree(saved[0], to, dirs_exist_ok=True)
    return saved[1]


def _fresh() -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    _, model, opt = build(1, 0, seed=1)
    return model, app_state(model, opt, TrainingState()), full_params(model)


def _shard(checkpoint: Path) -> Path:
    (found,) = sorted(checkpoint.glob("*.distcp"))
    return found


def test_a_saved_checkpoint_lists_every_file_with_its_size_and_sha256(
    tmp_path: Path, saved: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    _copy(saved, tmp_path)
    checkpoint = tmp_path / "step-2"
    manifest = read_manifest(checkpoint)
    assert manifest is not None and manifest["info"] == {"seed": 3}
    on_disk = {p.name for p in checkpoint.iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_zeroed_shard_is_refused_naming_the_file_and_the_newest_intact_step(
    tmp_path: Path, saved: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    _copy(saved, tmp_path)
    shard = _shard(tmp_path / "step-2")
    with shard.open("r+b") as f:  # 4 KiB of zeros in place: the size is unchanged
        f.seek(64)
        f.write(bytes(4096))
    model, state, before = _fresh()
    with pytest.raises(CheckpointCorruptError) as error:
        load(state, tmp_path)
    assert error.value.file == shard.name and error.value.intact == 1
    message = str(error.value)
    assert f"{tmp_path / 'step-2'} is damaged: {shard.name} has SHA-256" in message
    assert f"newest intact checkpoint is step 1 ({tmp_path / 'step-1'}): load it with step=1" in (
        message
    )
    after = full_params(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing was loaded
    assert load(state, tmp_path, step=1) == 1  # the intact one, picked by its step


class _Planted:
    """Unpickled, it creates the marker file: what a planted ``.metadata`` could run instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_planted_metadata_is_refused_before_it_is_unpickled(
    tmp_path: Path, saved: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    _copy(saved, tmp_path)
    marker = tmp_path / "code-ran"
    (tmp_path / "step-2" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    _, state, _ = _fresh()
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata has \d+ bytes, expected \d+"):
        load(state, tmp_path)
    assert not marker.exists()
    # the oracle that the payload is live: without the manifest, loading unpickles it
    (tmp_path / "step-2" / MANIFEST).unlink()
    with pytest.warns(UnverifiedCheckpointWarning), pytest.raises(Exception):  # noqa: B017
        load(state, tmp_path)
    assert marker.exists()


def test_a_truncated_shard_and_an_unreadable_manifest_are_named(
    tmp_path: Path, saved: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    _copy(saved, tmp_path)
    shard = _shard(tmp_path / "step-2")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    _, state, _ = _fresh()
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name} has {size // 2} bytes"):
        load(state, tmp_path)
    (tmp_path / "step-1" / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=rf"{MANIFEST} is unreadable") as error:
        load(state, tmp_path, step=1)
    assert error.value.intact is None and "no older checkpoint" in str(error.value)


def test_a_checkpoint_saved_before_manifests_loads_with_a_warning(
    tmp_path: Path, saved: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    params = _copy(saved, tmp_path)
    (tmp_path / "step-2" / MANIFEST).unlink()
    model, state, _ = _fresh()
    with pytest.warns(UnverifiedCheckpointWarning, match="has no manifest.json"):
        assert load(state, tmp_path) == 2
    after = full_params(model)
    assert all(torch.equal(after[k], v) for k, v in params.items())
    assert json.loads((tmp_path / "step-1" / MANIFEST).read_text())["version"] == 1

"""hp DTensors save and load with torch.distributed.checkpoint (DCP) itself, resharding on load.

Oracles: the full tensors the DTensors were made from, and torch's own DTensor
(loading hp's checkpoint into torch DTensors and the reverse; the checkpoint
metadata hp writes equals torch's for the same layouts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.tensor as tdt
from tests._harness import run_on_ranks, world_sizes
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)


def _values() -> dict[str, torch.Tensor]:
    """Full tensors with odd sizes, so that 2 and 4 ranks get uneven and empty shards."""
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(5, 3, generator=g),
        "cols": torch.randn(2, 7, generator=g),
        "rep": torch.randn(3, generator=g),
        "tiny": torch.randn(1, 2, generator=g),
        "grid": torch.randn(6, 5, generator=g),
    }


def _layouts_1d(hp: bool) -> dict[str, tuple[Any, ...]]:
    s, r = (Shard, Replicate) if hp else (tdt.Shard, tdt.Replicate)
    return {"rows": (s(0),), "cols": (s(1),), "rep": (r(),), "tiny": (s(0),), "grid": (s(1),)}


def _layouts_2d(hp: bool) -> dict[str, tuple[Any, ...]]:
    s, r = (Shard, Replicate) if hp else (tdt.Shard, tdt.Replicate)
    return {
        "rows": (s(0), s(0)),
        "cols": (r(), s(1)),
        "rep": (r(), r()),
        "tiny": (s(1), s(0)),
        "grid": (s(0), s(1)),
    }


def _mesh(hp: bool, two_d: bool) -> Any:
    world = torch.distributed.get_world_size()
    make = init_device_mesh if hp else torch_init_device_mesh
    if two_d:
        return make("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return make("cpu", (world,), mesh_dim_names=("tp",))


def _distributed(hp: bool, two_d: bool) -> dict[str, Any]:
    mesh = _mesh(hp, two_d)
    layouts = (_layouts_2d if two_d else _layouts_1d)(hp)
    distribute = distribute_tensor if hp else tdt.distribute_tensor
    return {k: distribute(v, mesh, layouts[k]) for k, v in _values().items()}


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    for value in state.values():
        value.to_local().zero_() if hasattr(value, "to_local") else value.zero_()
    return state


def _save(path: str, saver: str, two_d: bool) -> None:
    dcp_save(_distributed(saver == "hp", two_d), checkpoint_id=path)


def _load(path: str, loader: str, two_d: bool) -> dict[str, bool]:
    """Load into ``loader``'s tensors (zeroed first); compare each with the full value."""
    if loader == "plain":
        state: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _values().items()}
    else:
        state = _empty_like(_distributed(loader == "hp", two_d))
    dcp_load(state, checkpoint_id=path)
    full = _values()
    return {
        k: torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, full[k])
        for k, v in state.items()
    }


# (saver, saved on a 2-d mesh, loader, loaded on a 2-d mesh)
CASES = [
    ("hp", True, "hp", False),
    ("hp", False, "hp", True),
    ("hp", True, "torch", False),
    ("hp", False, "plain", False),
    ("torch", True, "hp", False),
    ("torch", False, "hp", True),
]


@world_sizes(2, 4)
def test_dcp_round_trip_reshards_between_hp_torch_and_plain(
    world_size: int, tmp_path: Path
) -> None:
    for i, (saver, save_2d, loader, load_2d) in enumerate(CASES):
        if world_size == 2 and (save_2d or load_2d):
            continue  # a 2-d mesh needs 4 ranks
        path = str(tmp_path / f"case{i}")
        run_on_ranks(_save, world_size, path, saver, save_2d)
        for found in run_on_ranks(_load, world_size, path, loader, load_2d):
            assert all(found.values()), (saver, save_2d, loader, load_2d, found)


def _chunks(path: str) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    metadata = FileSystemReader(path).read_metadata()
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        assert isinstance(md, TensorStorageMetadata)
        chunks[fqn] = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
    return chunks


def test_dcp_metadata_equals_torch_dtensor_replicas_written_once(tmp_path: Path) -> None:
    for two_d in (False, True):
        run_on_ranks(_save, 4, str(tmp_path / f"hp{two_d}"), "hp", two_d)
        run_on_ranks(_save, 4, str(tmp_path / f"torch{two_d}"), "torch", two_d)
        ours, theirs = (
            _chunks(str(tmp_path / f"hp{two_d}")),
            _chunks(str(tmp_path / f"torch{two_d}")),
        )
        assert ours == theirs
        assert len(ours["rep"]) == 1  # replicated on every rank, written once
        storage = FileSystemReader(str(tmp_path / f"hp{two_d}")).read_metadata().storage_data
        assert sum(1 for index in storage if index.fqn == "rep") == 1


def _save_partial(path: str) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    try:
        dcp_save({"p": partial}, checkpoint_id=path)
    except CheckpointException as error:  # DCP's wrapper of every rank's failure
        return str(error)
    return ""


def test_dcp_save_of_partial_dtensor_raises_naming_the_fix(tmp_path: Path) -> None:
    for error in run_on_ranks(_save_partial, 2, str(tmp_path / "p")):
        assert "partial values" in error and "Replicate()" in error


# -- a parallelized model ------------------------------------------------------------

CONFIG = Llama.Config(vocab_size=24, dim=16, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=24)


def _model(mesh: DeviceMesh | None, seed: int) -> Llama:
    torch.manual_seed(seed)
    model: Llama = CONFIG.build()
    model.init_weights()
    if mesh is not None:
        model.parallelize(mesh)
    return model


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }


def _save_model(path: str, dp: int, tp: int) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model(mesh["tp"], seed=0)
    dcp_save(model.state_dict(), checkpoint_id=path)
    return _full_state(model)


def _load_model(path: str, dp: int, tp: int) -> dict[str, Any]:
    """Load into a model built with other values, on a (dp, tp) mesh or unparallelized (tp=0)."""
    mesh = None if tp == 0 else init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model(None if mesh is None else mesh["tp"], seed=1)
    placements = {k: getattr(v, "placements", None) for k, v in model.state_dict().items()}
    state = model.state_dict()
    dcp_load(state, checkpoint_id=path)
    after = {k: getattr(v, "placements", None) for k, v in model.state_dict().items()}
    return {"full": _full_state(model), "kept": placements == after}


def test_dcp_model_saved_on_dp2_tp2_loads_on_tp4_tp1_and_unparallelized(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_model, 4, path, 2, 2)[0]
    for world, dp, tp in [(4, 1, 4), (2, 2, 1), (2, 1, 0)]:
        for result in run_on_ranks(_load_model, world, path, dp, tp):
            assert result["kept"], (dp, tp)
            assert result["full"].keys() == saved.keys()
            for key, value in saved.items():
                assert torch.equal(result["full"][key], value), (dp, tp, key)

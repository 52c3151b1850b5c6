"""DTensor and DeviceMesh survive pickle, copy.deepcopy and torch.save/torch.load, as torch's do."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.tensor as tdt
from tests._harness import run_on_ranks, world_sizes
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)


def _torch_save_load(obj: object) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # the default: weights_only=True


ROUND_TRIPS: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
    "torch.save": _torch_save_load,
}


def _names(placements: Any) -> list[str]:
    """Placements as comparable text across hp and torch (whose Partial reprs differ)."""
    return [f"{type(p).__name__}{getattr(p, 'dim', '')}" for p in placements]


def _round_trips_like_torch() -> dict[str, Any]:
    """For each round trip and layout: hp's result compared with torch DTensor's on the same input."""
    world = torch.distributed.get_world_size()
    hp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch_mesh = torch_init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)  # 5 rows: uneven on 2 and 4
    found: dict[str, Any] = {}
    for hp_p, torch_p in [
        (Shard(0), tdt.Shard(0)),
        (Replicate(), tdt.Replicate()),
        (Partial(), tdt.Partial()),
    ]:
        if hp_p.is_partial():
            local = full / world
            hp = DTensor.from_local(local, hp_mesh, [hp_p])
            ref = tdt.DTensor.from_local(local, torch_mesh, [torch_p])
        else:
            hp = distribute_tensor(full, hp_mesh, [hp_p])
            ref = tdt.distribute_tensor(full, torch_mesh, [torch_p])
        hp.requires_grad_()
        ref.requires_grad_()
        for name, trip in ROUND_TRIPS.items():
            a, b = trip(hp), trip(ref)
            found[f"{name}/{hp_p!r}"] = {
                "type": type(a) is DTensor,
                "placements": (_names(a.placements), _names(b.placements)),
                "shape": (tuple(a.shape), tuple(b.shape)),
                "local": torch.equal(a.to_local(), b.to_local()),
                "full": torch.equal(
                    a.full_tensor(), b.full_tensor()
                ),  # a collective: mesh attached
                "requires_grad": (a.requires_grad, b.requires_grad),
                "mesh": a.device_mesh == hp_mesh
                and a.device_mesh.get_group() is hp_mesh.get_group(),
                "copied": hp.to_local().numel() == 0  # an empty shard has no data pointer
                or a.to_local().data_ptr() != hp.to_local().data_ptr(),
            }
    return found


@world_sizes(2, 4)
def test_dtensor_round_trips_like_torch_dtensor(world_size: int) -> None:
    for found in run_on_ranks(_round_trips_like_torch, world_size):
        for case, result in found.items():
            assert result["type"], case
            assert result["placements"][0] == result["placements"][1], case
            assert result["shape"][0] == result["shape"][1], case
            assert result["local"] and result["full"], case
            assert result["requires_grad"] == (True, True), case
            assert result["mesh"] and result["copied"], case


def _mesh_round_trips() -> list[bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    checks: list[bool] = []
    for trip in ROUND_TRIPS.values():
        for m in (mesh, mesh["tp"], mesh["dp"]):
            back: DeviceMesh = trip(m)
            ones = torch.ones(1)
            torch.distributed.all_reduce(ones, group=back.get_group(0))
            checks += [back == m, back.get_coordinate() == m.get_coordinate(), ones.item() == 2]
    return checks


def test_device_mesh_round_trips_reattach_groups() -> None:
    for checks in run_on_ranks(_mesh_round_trips, 4):
        assert all(checks)


# (placements of the parameters of a tensor-parallel MLP: column- then row-parallel)
MLP_LAYOUT = {
    "0.weight": (Shard(0),),
    "0.bias": (Shard(0),),
    "2.weight": (Shard(1),),
    "2.bias": (Replicate(),),
}


def _parallel_mlp(mesh: DeviceMesh, seed: int = 0) -> torch.nn.Module:
    """A two-layer MLP whose parameters are DTensors (hp-dtensor alone, no hp-dmodule)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    for name, param in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        sharded = distribute_tensor(param.detach(), mesh, MLP_LAYOUT[name])
        setattr(model.get_submodule(module), attr, torch.nn.Parameter(sharded))
    return model


def _save_state_dict(directory: str) -> dict[str, list[float]]:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    model = _parallel_mlp(mesh)
    rank = torch.distributed.get_rank()
    torch.save(model.state_dict(), Path(directory) / f"rank{rank}.pt")
    torch.save(mesh, Path(directory) / f"mesh{rank}.pt")
    return {k: v.full_tensor().flatten().tolist() for k, v in model.state_dict().items()}


def _load_state_dict(directory: str) -> dict[str, Any]:
    """In a new process group: load the files with the mesh built, into a freshly built model."""
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    loaded = torch.load(Path(directory) / f"rank{rank}.pt")
    assert torch.load(Path(directory) / f"mesh{rank}.pt") is mesh
    model = _parallel_mlp(mesh, seed=1)  # other initial values: the load must replace them
    model.load_state_dict(loaded)
    state = model.state_dict()
    return {
        "full": {k: v.full_tensor().flatten().tolist() for k, v in state.items()},
        "placements": {k: (v.placements, loaded[k].placements) for k, v in state.items()},
        "reattached": all(v.device_mesh is mesh for v in loaded.values()),
    }


def test_torch_save_of_parallelized_state_dict_loads_in_a_new_process_group(
    tmp_path: Path,
) -> None:
    saved = run_on_ranks(_save_state_dict, 2, str(tmp_path))
    loaded = run_on_ranks(_load_state_dict, 2, str(tmp_path))
    for result in loaded:
        assert result["reattached"]
        assert result["full"] == saved[0]
        for key, (have, came) in result["placements"].items():
            assert have == came, key


def _load_without_mesh(directory: str) -> dict[str, Any]:
    """A process group without the mesh: the shards load; collectives on them say what is missing."""
    loaded = torch.load(Path(directory) / f"rank{torch.distributed.get_rank()}.pt")
    weight = loaded["0.weight"]
    try:
        weight.full_tensor()
        error = ""
    except RuntimeError as e:
        error = str(e)
    return {"local": weight.to_local().shape, "global": weight.shape, "error": error}


def test_unpickled_without_its_mesh_holds_shards_and_names_the_missing_mesh(
    tmp_path: Path,
) -> None:
    run_on_ranks(_save_state_dict, 2, str(tmp_path))
    for result in run_on_ranks(_load_without_mesh, 2, str(tmp_path)):
        assert result["local"][0] * 2 == result["global"][0]
        assert "no process groups" in result["error"] and "build the mesh" in result["error"]


def _load_other_ranks_file(directory: str) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    other = 1 - torch.distributed.get_rank()
    with pytest.raises(ValueError, match=f"saved by rank {other}") as info:
        torch.load(Path(directory) / f"rank{other}.pt")
    assert mesh.get_rank() != other
    return str(info.value)


def test_loading_another_ranks_shard_raises_instead_of_mixing_shards(tmp_path: Path) -> None:
    run_on_ranks(_save_state_dict, 2, str(tmp_path))
    run_on_ranks(_load_other_ranks_file, 2, str(tmp_path))


def _deepcopy_model_trains_like_original() -> list[bool]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _parallel_mlp(mesh)
    twin = copy.deepcopy(model)
    x = distribute_tensor(torch.randn(3, 6), mesh, [Replicate()])
    checks: list[bool] = []
    for m in (model, twin):
        m(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert isinstance(q, torch.nn.Parameter) and isinstance(q, DTensor), name
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
        assert isinstance(q.grad, DTensor)
        checks += [
            q.to_local().data_ptr() != p.to_local().data_ptr(),
            q.placements == p.placements,
            q.grad.placements == p.grad.placements,  # the copy's leaf hook lays grads out too
            torch.equal(q.grad.full_tensor(), p.grad.full_tensor()),
        ]
    return checks


def test_deepcopy_of_parallelized_model_is_independent_and_trains_alike() -> None:
    for checks in run_on_ranks(_deepcopy_model_trains_like_original, 2):
        assert all(checks)

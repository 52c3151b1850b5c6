"""DeviceMesh on real gloo groups: shape, coordinates, sub-meshes, groups, errors.

Group membership is checked by collectives: an all-gather of global ranks over
``mesh.get_group(axis)`` must give exactly the mesh slice through this rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tests._harness import run_on_ranks

from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.platform import get_platform


def _gathered_ranks(mesh: DeviceMesh, axis: int | str | None = None) -> list[int]:
    platform = get_platform()
    mine = torch.tensor([dist.get_rank()])
    return platform.all_gather(mine, mesh.get_group(axis)).flatten().tolist()


def _summed_ranks(mesh: DeviceMesh, axis: int | str) -> int:
    platform = get_platform()
    return int(platform.all_reduce(torch.tensor([dist.get_rank()]), mesh.get_group(axis), "sum"))


def _one_d() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    return {
        "shape": mesh.shape,
        "ndim": mesh.ndim,
        "size": (mesh.size(), mesh.size("tp"), mesh.size(0), mesh.size(dim=0)),
        "local_rank": (mesh.get_local_rank(), mesh.get_local_rank("tp")),
        "coordinate": mesh.get_coordinate(),
        "gathered": _gathered_ranks(mesh),
        "sub_is_same": mesh["tp"] == mesh and mesh["tp"].get_group() is mesh.get_group(),
        "repr": repr(mesh),
    }


def test_one_d_mesh_on_four_ranks() -> None:
    results = run_on_ranks(_one_d, 4)
    for rank, out in enumerate(results):
        assert out["shape"] == (4,) and out["ndim"] == 1
        assert out["size"] == (4, 4, 4, 4)
        assert out["local_rank"] == (rank, rank)
        assert out["coordinate"] == [rank]
        assert out["gathered"] == [0, 1, 2, 3]
        assert out["sub_is_same"] is True
        assert out["repr"] == "DeviceMesh('cpu', [0, 1, 2, 3], mesh_dim_names=('tp',))"


def _two_d() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp, swapped = mesh["tp"], mesh["dp"], mesh["tp", "dp"]
    same = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "shape": mesh.shape,
        "sizes": (mesh.size(), mesh.size("dp"), mesh.size("tp"), mesh.size(-1)),
        "coordinate": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), mesh.get_local_rank(1)),
        "axis_index": (mesh.axis_index("dp"), mesh.axis_index("tp"), mesh.axis_index(-2)),
        "tp_mesh": tp.mesh.tolist(),
        "dp_mesh": dp.mesh.tolist(),
        "swapped_mesh": swapped.mesh.tolist(),
        "sub_names": (tp.mesh_dim_names, swapped.mesh_dim_names),
        "sub_local": (tp.get_local_rank(), dp.get_local_rank()),
        "sub_coordinate": (tp.get_coordinate(), swapped.get_coordinate()),
        "groups_reused": (
            tp.get_group() is mesh.get_group("tp"),
            dp.get_group() is mesh.get_group("dp"),
            swapped.get_group("dp") is mesh.get_group("dp"),
        ),
        "gathered_tp": _gathered_ranks(mesh, "tp"),
        "gathered_dp": _gathered_ranks(mesh, 0),
        "gathered_sub_tp": _gathered_ranks(tp),
        "summed_tp": _summed_ranks(mesh, "tp"),
        "summed_dp": _summed_ranks(mesh, "dp"),
        "equal": (same == mesh, hash(same) == hash(mesh), mesh["dp", "tp"] == mesh, tp == mesh),
        "repr": (repr(mesh), repr(tp)),
        "mesh_tensor": (mesh.mesh.dtype, mesh.mesh.device.type),
    }


def test_two_d_mesh_sub_meshes_and_groups_on_four_ranks() -> None:
    results = run_on_ranks(_two_d, 4)
    grid = torch.arange(4).reshape(2, 2)  # the oracle: row-major ranks
    for rank, out in enumerate(results):
        row, col = divmod(rank, 2)
        assert out["shape"] == (2, 2)
        assert out["sizes"] == (4, 2, 2, 2)
        assert out["coordinate"] == [row, col]
        assert out["local"] == (row, col, col)
        assert out["axis_index"] == (0, 1, 0)
        assert out["tp_mesh"] == grid[row].tolist()
        assert out["dp_mesh"] == grid[:, col].tolist()
        assert out["swapped_mesh"] == grid.t().tolist()
        assert out["sub_names"] == (("tp",), ("tp", "dp"))
        assert out["sub_local"] == (col, row)
        assert out["sub_coordinate"] == ([col], [col, row])
        assert out["groups_reused"] == (True, True, True)
        assert out["gathered_tp"] == grid[row].tolist() == out["gathered_sub_tp"]
        assert out["gathered_dp"] == grid[:, col].tolist()
        assert out["summed_tp"] == int(grid[row].sum())
        assert out["summed_dp"] == int(grid[:, col].sum())
        assert out["equal"] == (True, True, True, False)
        assert out["repr"] == (
            "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))",
            f"DeviceMesh('cpu', {grid[row].tolist()}, mesh_dim_names=('tp',))",
        )
        assert out["mesh_tensor"] == (torch.int64, "cpu")


def _unusual_meshes() -> dict[str, object]:
    permuted = DeviceMesh("cpu", [3, 1, 2, 0])
    subset = DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("a", "b"))
    trivial = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "one"))
    out: dict[str, object] = {
        "permuted_gathered": _gathered_ranks(permuted),
        "permuted_local": permuted.get_local_rank(),
        "subset_coordinate": subset.get_coordinate(),
        "trivial_gathered": _gathered_ranks(trivial, "one"),
        "trivial_local": trivial.get_local_rank("one"),
        "no_names": DeviceMesh("cpu", [0, 1, 2, 3]).mesh_dim_names,
    }
    if dist.get_rank() in (0, 1):
        out["subset_gathered"] = _gathered_ranks(subset, "b")
    else:
        with pytest.raises(
            RuntimeError, match=rf"get_local_rank: rank {dist.get_rank()} is not in"
        ):
            subset.get_local_rank("b")
        with pytest.raises(RuntimeError, match=r"get_group: rank \d is not in this mesh.*\[0, 1\]"):
            subset.get_group("b")
        with pytest.raises(RuntimeError, match=r"not in this mesh"):
            subset["a"]
    return out


def test_permuted_subset_and_size_one_meshes() -> None:
    results = run_on_ranks(_unusual_meshes, 4)
    for rank, out in enumerate(results):
        assert out["permuted_gathered"] == [3, 1, 2, 0]
        assert out["permuted_local"] == [3, 1, 2, 0].index(rank)
        assert out["subset_coordinate"] == ([0, rank] if rank < 2 else None)
        assert out.get("subset_gathered") == ([0, 1] if rank < 2 else None)
        assert out["trivial_gathered"] == [rank]
        assert out["trivial_local"] == 0
        assert out["no_names"] is None


def _errors() -> None:
    with pytest.raises(ValueError, match=r"\(3,\) holds 3 ranks but the world size is 4"):
        init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match=r"positive ints, got \(2, 0\)"):
        init_device_mesh("cpu", (2, 0))
    with pytest.raises(ValueError, match=r"positive ints, got \(-4,\)"):
        init_device_mesh("cpu", (-4,))
    with pytest.raises(ValueError, match=r"must be distinct; \('tp', 'tp'\) repeats \['tp'\]"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "tp"))
    with pytest.raises(ValueError, match=r"non-empty strings.*positions \[1\]"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", ""))
    with pytest.raises(ValueError, match=r"has 1 names but the mesh has 2 axes"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"holds 8 ranks but the world size is 4"):
        DeviceMesh("cpu", torch.arange(8))
    with pytest.raises(ValueError, match=r"repeated ranks \[1\]"):
        DeviceMesh("cpu", [0, 1, 1, 2])
    with pytest.raises(ValueError, match=r"in \[0, 4\).*got \[7\]"):
        DeviceMesh("cpu", [0, 7])
    with pytest.raises(ValueError, match=r"positive size, got shape \(2, 0\)"):
        DeviceMesh("cpu", torch.empty(2, 0, dtype=torch.int64))
    with pytest.raises(ValueError, match="unsupported device_type 'gpu'"):
        init_device_mesh("gpu", (4,))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"no axis named 'pp'; mesh axes are \('dp', 'tp'\)"):
        mesh.size("pp")
    with pytest.raises(ValueError, match=r"no axis named 'pp'"):
        mesh.get_local_rank("pp")
    with pytest.raises(ValueError, match=r"cannot slice by \('tp', 'pp'\): no axis named 'pp'"):
        mesh["tp", "pp"]
    with pytest.raises(ValueError, match=r"axis 2 is out of range for a 2-d mesh"):
        mesh.get_group(2)
    with pytest.raises(ValueError, match=r"omitted only on a 1-d mesh.*shape \(2, 2\)"):
        mesh.get_local_rank()
    with pytest.raises(ValueError, match=r"omitted only on a 1-d mesh"):
        mesh.get_group()
    with pytest.raises(ValueError, match="names an axis twice"):
        mesh["tp", "tp"]
    unnamed = DeviceMesh("cpu", [0, 1, 2, 3])
    with pytest.raises(ValueError, match="no axis names"):
        unnamed["tp"]
    with pytest.raises(ValueError, match="no axis names"):
        unnamed.size("tp")


def test_invalid_meshes_and_axes_raise_clear_errors() -> None:
    run_on_ranks(_errors, 4)


def _single_rank() -> tuple[object, ...]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    return mesh.shape, mesh.get_coordinate(), _gathered_ranks(mesh, "tp")


def test_world_size_one_mesh() -> None:
    assert run_on_ranks(_single_rank, 1) == [((1,), [0], [0])]

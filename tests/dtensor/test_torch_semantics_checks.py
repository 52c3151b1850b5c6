"""Building a DTensor from every rank's pieces: checked across ranks, sources as in torch.

Ported from torch's ``test_from_local`` / ``test_distribute_tensor*`` /
``test_dtensor_sub_mesh`` cases, plus misuse probes:

* ``from_local(..., run_check=True)`` checks dtype, placements, every non-sharded dim
  and the uneven (``torch.chunk``) shard sizes across ranks; every rank raises the
  same clear error (torch checks dtype and shape; its later collectives abort on
  the rest).
* ``distribute_tensor`` given a different full shape or dtype on different ranks
  fails clearly on every rank.
* ``src_data_rank`` is a group rank on each mesh axis; ``distribute_tensor`` on a
  sub-mesh works on every rank of the parent mesh; ranks outside a mesh hold empty
  local tensors and compute nothing.

Oracles: torch.distributed.tensor on the same inputs (local values, local shapes,
collective counts, whether it raises) and the full tensors in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._torch_twin import hp_side, layout, sides, torch_side

from hyper_parallel.dtensor import DeviceMesh, Replicate, Shard, distribute_tensor


def _error(fn: Callable[[], object]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _run_check_probes(world_size: int) -> dict[str, Any]:
    rank = dist.get_rank()
    ours = hp_side((world_size,))
    theirs = torch_side((world_size,))
    probes: dict[str, Callable[[Any], object]] = {
        "shape (2,3) vs (2,4)": lambda s: s.from_local(
            torch.zeros(2, 3 + (rank == 1)), [s.Shard(0)], run_check=True
        ),
        "dtype f32 vs f64": lambda s: s.from_local(
            torch.zeros(2, 3, dtype=torch.float64 if rank == world_size - 1 else torch.float32),
            [s.Shard(0)],
            run_check=True,
        ),
        "Replicate (2,) vs (3,)": lambda s: s.from_local(
            torch.zeros(2 + (rank == 1)), [s.Replicate()], run_check=True
        ),
    }
    # torch does not check these across ranks; we do
    ours_only: dict[str, Callable[[Any], object]] = {
        "placements Shard(0) vs Shard(1)": lambda s: s.from_local(
            torch.zeros(2, 2), [s.Shard(rank % 2)], run_check=True
        ),
        "uneven shards not in torch.chunk layout": lambda s: s.from_local(
            torch.zeros(2 if rank != 0 else 1, 3), [s.Shard(0)], run_check=True
        ),
        "requires_grad differs": lambda s: s.from_local(
            torch.zeros(2, requires_grad=rank == 0), [s.Replicate()], run_check=True
        ),
    }
    out: dict[str, Any] = {}
    for name, probe in probes.items():
        out[name] = {"ours": _error(partial(probe, ours)), "torch": _error(partial(probe, theirs))}
    for name, probe in ours_only.items():
        out[name] = {"ours": _error(partial(probe, ours)), "torch": None}
    # uneven shards in torch.chunk layout are fine: the global shape is their sum
    sizes = [len(c) for c in torch.arange(2 * world_size + 1).chunk(world_size)]
    sizes += [0] * (world_size - len(sizes))
    full = torch.arange(float(sum(sizes) * 3)).reshape(-1, 3)
    start = sum(sizes[:rank])
    uneven = ours.from_local(full[start : start + sizes[rank]], [Shard(0)], run_check=True)
    out["uneven ok"] = (tuple(uneven.shape), torch.equal(uneven.full_tensor(), full))
    return out


@world_sizes(2, 4)
def test_from_local_run_check_raises_the_same_clear_error_on_every_rank(world_size: int) -> None:
    results = run_on_ranks(_run_check_probes, world_size, world_size)
    for name in results[0]:
        if name == "uneven ok":
            continue
        ours = [r[name]["ours"] for r in results]
        assert ours[0] is not None, f"{name}: no error"
        assert all(o == ours[0] for o in ours), f"{name}: ranks raised differently: {ours}"
        kind, message = ours[0]
        assert kind == "PlacementError" and "run_check=True" in message, ours[0]
        torch_errors = [r[name]["torch"] for r in results]
        if name in ("shape (2,3) vs (2,4)", "dtype f32 vs f64", "Replicate (2,) vs (3,)"):
            assert all(t is not None for t in torch_errors), (name, torch_errors)
    for r in results:
        shape, equal = r["uneven ok"]
        assert equal and shape[1] == 3
    messages = {name: results[0][name]["ours"][1] for name in results[0] if name != "uneven ok"}
    assert "dim 1, which no mesh axis shards" in messages["shape (2,3) vs (2,4)"]
    assert "torch.float64" in messages["dtype f32 vs f64"]
    assert "Shard(dim=1)" in messages["placements Shard(0) vs Shard(1)"]
    assert "torch.chunk" in messages["uneven shards not in torch.chunk layout"]


def _distribute_mismatch(world_size: int) -> dict[str, Any]:
    rank = dist.get_rank()
    ours = hp_side((world_size,))
    shape = _error(lambda: ours.distribute(torch.zeros(4 + (rank == 1), 2), [Shard(0)]))
    dtype = _error(
        lambda: ours.distribute(
            torch.zeros(4, 2, dtype=torch.float64 if rank == 0 else torch.float32), [Replicate()]
        )
    )
    return {"shape": shape, "dtype": dtype}


@world_sizes(2, 4)
def test_distribute_tensor_with_different_shapes_or_dtypes_fails_on_every_rank(
    world_size: int,
) -> None:
    results = run_on_ranks(_distribute_mismatch, world_size, world_size)
    for what in ("shape", "dtype"):
        errors = [r[what] for r in results]
        assert errors[0] is not None and all(e == errors[0] for e in errors), errors
        assert errors[0][0] == "PlacementError"
        assert f"disagree on the {what}" in errors[0][1]


def _src_data_rank_and_sub_meshes() -> dict[str, Any]:
    rank = dist.get_rank()
    full = torch.arange(24.0).reshape(4, 6)
    own = full + 100 * rank  # each rank's copy differs: the source decides
    out: dict[str, Any] = {}
    for side in sides((2, 2), ("dp", "tp")):
        res: dict[str, Any] = {}
        for placements in ([side.Shard(0), side.Shard(1)], [side.Replicate(), side.Shard(0)]):
            for src in (0, 1, None):
                # a copy per call: torch's distribute_tensor broadcasts into its input
                dt = side.distribute(own.clone(), placements, src_data_rank=src)
                res[f"2-D {layout(dt)} src={src}"] = dt.to_local()
        tp = side.mesh["tp"]
        with side.comm() as counts:
            sub = side.module.distribute_tensor(own.clone(), tp, [side.Shard(0)])
        res["mesh['tp'] local"] = sub.to_local()
        res["mesh['tp'] comm"] = counts
        res["mesh['tp'] full"] = sub.full_tensor()
        dp = side.mesh["dp"]
        res["mesh['dp'] src=1"] = side.module.distribute_tensor(
            own.clone(), dp, [side.Replicate()], src_data_rank=1
        ).to_local()
        out[side.name] = res
    return out


def test_src_data_rank_is_a_group_rank_per_mesh_axis_like_torch() -> None:
    for rank, result in enumerate(run_on_ranks(_src_data_rank_and_sub_meshes, 4)):
        ours, theirs = result["hp"], result["torch"]
        assert ours.keys() == theirs.keys()
        # README: distribute_tensor checks every rank's shape and dtype first, with one
        # all-gather of a small record per mesh axis the mesh spans
        theirs["mesh['tp'] comm"]["all_gather"] = 1
        for key, value in ours.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[key]), (rank, key, value, theirs[key])
            else:
                assert value == theirs[key], (rank, key, value, theirs[key])


def _outside_the_mesh() -> dict[str, Any]:
    rank = dist.get_rank()
    full = torch.arange(12.0).reshape(4, 3)
    out: dict[str, Any] = {}
    for name in ("hp", "torch"):
        if name == "hp":
            mesh: Any = DeviceMesh("cpu", [0, 1])
            dt: Any = distribute_tensor(full, mesh, [Shard(0)])
        else:
            import torch.distributed.tensor as tdt
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh

            mesh = TorchMesh("cpu", [0, 1])
            dt = tdt.distribute_tensor(full, mesh, [tdt.Shard(0)])
        y = (dt @ dt.t()).relu().sum(0)
        pieces = torch.split(dt, 2, dim=0)
        out[name] = {
            "local": tuple(dt.to_local().shape),
            "op local": tuple(y.to_local().shape),
            "op shape": tuple(y.shape),
            "op layout": layout(y),
            "split locals": [tuple(p.to_local().shape) for p in pieces],  # type: ignore[attr-defined]
        }
        if rank < 2:
            out[name]["value"] = torch.equal(y.full_tensor(), (full @ full.t()).relu().sum(0))
    return out


def test_ranks_outside_a_mesh_hold_empty_locals_and_compute_nothing_like_torch() -> None:
    for rank, result in enumerate(run_on_ranks(_outside_the_mesh, 4)):
        if rank >= 2:  # torch labels outputs on ranks outside the mesh differently: unused
            result["hp"].pop("op layout")
            result["torch"].pop("op layout")
        assert result["hp"] == result["torch"], (rank, result)
        if rank >= 2:
            assert result["hp"]["local"] == (0,) and result["hp"]["op local"] == (0,)
        else:
            assert result["hp"]["value"]

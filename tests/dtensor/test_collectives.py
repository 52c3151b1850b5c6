"""``hyper_parallel.dtensor.collectives``: values like torch.distributed's, and each call recorded
(kind, this rank's input bytes, group size, mesh axis) for CommDebugMode."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests._harness import run_on_ranks

from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    init_device_mesh,
)


def _records_on_a_named_2x2_mesh() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with CommDebugMode() as comm:
        # along "tp" this rank's group is {2 * dp + 0, 2 * dp + 1}
        out["sum_tp"] = collectives.all_reduce(torch.tensor([float(rank)]), mesh, "tp").item()
        out["gathered_dp"] = collectives.all_gather(torch.tensor([rank]), mesh, "dp").tolist()
        x = distribute_tensor(torch.arange(24.0).view(4, 6), mesh, [Replicate(), Shard(1)])
        y = F.softmax(x, dim=1)
        assert isinstance(y, DTensor)
        out["softmax_ok"] = torch.allclose(
            y.full_tensor(), F.softmax(torch.arange(24.0).view(4, 6), dim=1)
        )
    out["records"] = [(r.kind, r.nbytes, r.group_size, r.mesh_axis) for r in comm.records()]
    return out


def test_collectives_compute_over_the_named_axis_and_record_it() -> None:
    results = run_on_ranks(_records_on_a_named_2x2_mesh, 4, timeout_s=180)
    for rank, got in enumerate(results):
        dp, tp = divmod(rank, 2)
        assert got["sum_tp"] == float(2 * dp + 2 * dp + 1)
        assert got["gathered_dp"] == [[tp], [2 + tp]]
        assert got["softmax_ok"]
        records = got["records"]
        assert records[0] == ("all_reduce", 4, 2, "tp")  # one float32
        assert records[1] == ("all_gather", 8, 2, "dp")  # one int64
        # distribute_tensor from rank 0: the (4, 6) float32 tensor broadcast along "dp" (by
        # the ranks of rank 0's "dp" group), then its column halves scattered along "tp"; the
        # sharded softmax reduces in its kernel along "tp" (row max, sum of exponentials:
        # 4 rows each); full_tensor gathers along "tp"
        # Before that, distribute_tensor checks every rank's shape and dtype: one all-gather
        # of a 71-int64 record along "tp", then of the two gathered records along "dp".
        broadcast = [("broadcast", 96, 2, "dp")] if tp == 0 else []
        assert records[2:] == [
            ("all_gather", 568, 2, "tp"),
            ("all_gather", 1136, 2, "dp"),
            *broadcast,
            ("scatter", 48, 2, "tp"),
            ("all_reduce", 16, 2, "tp"),
            ("all_reduce", 16, 2, "tp"),
            ("all_gather", 48, 2, "tp"),
        ]


def _unnamed_axis_is_its_index() -> list[Any]:
    mesh = init_device_mesh("cpu", (2,))
    seen: list[collectives.CollectiveRecord] = []
    with collectives.observe_collectives(seen.append):
        collectives.broadcast(torch.zeros(3), mesh, 0, src=0)
        assert collectives.any_rank(dist.get_rank() == 1, mesh)
    return [(r.kind, r.mesh_axis, r.group_size) for r in seen]


def test_an_unnamed_mesh_axis_is_recorded_by_index() -> None:
    for got in run_on_ranks(_unnamed_axis_is_its_index, 2):
        assert got == [("broadcast", 0, 2), ("all_reduce", 0, 2)]


def _uneven_all_to_all_single() -> tuple[list[float], list[Any]]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    rank = dist.get_rank()
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends none to rank 0 and 1 to itself
    send = [1, 2] if rank == 0 else [0, 1]
    recv = [1, 0] if rank == 0 else [2, 1]
    rows = torch.arange(float(sum(send))).unsqueeze(1) + 10 * rank
    with CommDebugMode() as comm:
        got = collectives.all_to_all_single(rows, recv, send, mesh, "ep")
    return got.squeeze(1).tolist(), [(r.kind, r.nbytes, r.mesh_axis) for r in comm.records()]


def test_all_to_all_single_moves_uneven_rows_and_is_recorded_as_all_to_all() -> None:
    (got0, rec0), (got1, rec1) = run_on_ranks(_uneven_all_to_all_single, 2)
    assert got0 == [0.0] and got1 == [1.0, 2.0, 10.0]
    assert rec0 == [("all_to_all", 12, "ep")] and rec1 == [("all_to_all", 4, "ep")]

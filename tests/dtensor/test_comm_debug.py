"""CommDebugMode counts the collectives DTensor ops issue, charges them to modules, lists fallbacks.

Oracles: the collective a redistribution must use and the bytes of this rank's
shard, computed from the shapes; the fallback counter's own difference.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict

import pytest
import torch
from tests._harness import run_on_ranks
from torch import nn

from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
)
from hyper_parallel.dtensor._registry import rule_for

FALLBACK_OP = torch.ops.aten.cummax.default


class GatheringLinear(nn.Linear):
    """A column-parallel Linear that gathers its output (one all-gather inside forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        assert isinstance(y, DTensor)
        return y.redistribute(placements=[Replicate()])


def _comm_debug_mode_reports() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2,))
    report: dict[str, object] = {}

    # 1. Shard(0) -> Replicate of an (8, 4) float32: one all-gather of this rank's (4, 4) shard
    dt = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        dt.redistribute(placements=[Replicate()])
    report["redistribute_counts"] = comm.counts()
    report["redistribute_bytes"] = comm.bytes()
    report["table"] = comm.table()
    report["json"] = json.dumps(comm.to_dict())
    dt.redistribute(placements=[Replicate()])  # after exit: not counted
    report["counts_after_exit"] = comm.counts()

    # 2. a module's collectives are charged to its fully qualified name
    torch.manual_seed(0)
    proj = GatheringLinear(4, 6, bias=False)
    proj.weight = nn.Parameter(distribute_tensor(proj.weight.detach(), mesh, [Shard(0)]))
    model = nn.Sequential(OrderedDict(encoder=nn.Sequential(OrderedDict(proj=proj))))
    x = distribute_tensor(torch.randn(3, 4), mesh, [Replicate()])
    with CommDebugMode(model) as comm:
        model(x).sum().backward()
    report["by_module"] = comm.by_module()
    report["module_bytes"] = comm.to_dict()["by_module"]

    # 3. an op without a rule is listed with its count
    report["fallback_op_has_rule"] = rule_for(FALLBACK_OP) is not None
    before = fallback_counts()
    with CommDebugMode() as comm:
        torch.cummax(dt, dim=1)
    after = fallback_counts()
    report["fallbacks"] = comm.fallbacks()
    report["fallback_diff"] = {
        op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)
    }
    report["fallback_table"] = comm.table()

    # 4. torch's functional collectives issued outside hp-dtensor's collectives module (what
    # compiled code runs) are recorded, as torch's CommDebugMode counts them; hp's own
    # collectives that run as functional collectives (async_op=True) are recorded once
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    group = mesh.get_group()
    local = torch.randn(4, 3)

    def issue() -> None:
        collectives.wait(funcol.all_reduce(local, "sum", group))
        collectives.wait(funcol.all_gather_single(local, 0, group))
        collectives.wait(funcol.reduce_scatter_single(local, "sum", 0, group))

    with CommDebugMode() as comm, TorchCommDebugMode() as torch_comm:  # type: ignore[no-untyped-call]
        issue()
        pending = collectives.all_reduce(local, mesh, 0, async_op=True)
        collectives.wait(pending)
    report["funcol_records"] = comm.records()
    report["torch_funcol_counts"] = {
        str(op).split(".")[-1]: n for op, n in torch_comm.get_comm_counts().items()
    }
    # modes nest: each records every collective and charges it to the module once
    x = distribute_tensor(torch.randn(3, 4), mesh, [Replicate()])
    with CommDebugMode(model) as outer, CommDebugMode(model) as inner:
        model(x)
    report["nested_by_module"] = [outer.by_module(), inner.by_module()]
    return report


@functools.cache
def _report() -> dict[str, object]:
    return run_on_ranks(_comm_debug_mode_reports, 2, timeout_s=180)[1]


@pytest.mark.allows_fallback
def test_comm_debug_mode() -> None:
    r = _report()
    # redistribute S(0) -> R: one all_gather of this rank's (4, 4) float32 shard
    assert r["redistribute_counts"] == {"all_gather": 1}
    assert r["redistribute_bytes"] == {"all_gather": 4 * 4 * 4}
    assert "all_gather" in str(r["table"]) and "64" in str(r["table"])
    assert json.loads(str(r["json"]))["counts"] == {"all_gather": 1}
    assert r["counts_after_exit"] == {"all_gather": 1}
    # the all-gather of the (3, 6) output, 3 columns per rank, belongs to encoder.proj
    by_module = r["by_module"]
    assert isinstance(by_module, dict)
    assert by_module.get("encoder.proj", {}).get("all_gather") == 1
    module_bytes = r["module_bytes"]
    assert isinstance(module_bytes, dict)
    assert module_bytes["encoder.proj"]["all_gather"] == {"count": 1, "bytes": 3 * 3 * 4}
    # the fallback list is the fallback counter's difference over the block
    assert not r["fallback_op_has_rule"], "pick another op without a sharding rule for this test"
    assert r["fallbacks"] == r["fallback_diff"]
    assert str(FALLBACK_OP) in r["fallbacks"]  # type: ignore[operator]
    assert str(FALLBACK_OP) in str(r["fallback_table"])


def test_comm_debug_mode_records_functional_collectives_once() -> None:
    r = _report()
    records = r["funcol_records"]
    assert isinstance(records, list)
    torch_counts = r["torch_funcol_counts"]
    assert isinstance(torch_counts, dict)
    # torch's names for the same collectives (it sees hp's async all-reduce as one too)
    kinds = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather"}
    kinds["reduce_scatter_tensor"] = "reduce_scatter"
    want = {kinds[op]: n for op, n in torch_counts.items()}
    got: dict[str, int] = {}
    for record in records:
        got[record.kind] = got.get(record.kind, 0) + 1
    assert got == want == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}, (got, want)
    # this rank's (4, 3) float32 input; the group found as mesh axis 0 of 2 ranks
    assert {(rec.nbytes, rec.group_size, rec.mesh_axis) for rec in records} == {(48, 2, 0)}
    nested = r["nested_by_module"]
    assert isinstance(nested, list)
    outer, inner = nested
    assert outer == inner == {"encoder.proj": {"all_gather": 1}}, (outer, inner)

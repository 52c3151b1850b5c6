"""``redistribute(async_op=True)``: issued at once, waited at first use; torch DTensor's results and collectives."""

from __future__ import annotations

from typing import Any

import torch
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import full, layout, sides

# (source, target) layouts over one 2-rank axis; (5, 4) makes the Shard(0) cases uneven
MOVES = [
    ("S0", "R", (4, 6)),
    ("S0", "R", (5, 4)),
    ("S1", "R", (4, 6)),
    ("P", "R", (4, 6)),
    ("P", "S0", (4, 6)),
    ("S0", "S1", (4, 6)),
    ("R", "S1", (4, 6)),
]


def _placement(side: Any, kind: str) -> Any:
    if kind == "R":
        return side.Replicate()
    if kind == "P":
        return side.Partial()
    return side.Shard(int(kind[1:]))


def _source(side: Any, value: torch.Tensor, kind: str) -> Any:
    if kind == "P":
        rank = side.mesh.get_local_rank()
        return side.from_local(value * (rank + 1) / 3, [side.Partial()])
    return side.distribute(value, [_placement(side, kind)])


def _async_moves(moves: list[tuple[str, str, tuple[int, int]]]) -> list[dict[str, Any]]:
    """On each rank, per move and side: layout, collectives, pending-ness, values, gradients."""
    torch.set_num_threads(1)
    found: list[dict[str, Any]] = []
    for src, dst, shape in moves:
        torch.manual_seed(0)
        value = torch.randn(shape)
        row: dict[str, Any] = {"move": f"{src}->{dst} {shape}"}
        for side in sides((torch.distributed.get_world_size(),)):
            x = _source(side, value, src).detach().requires_grad_()
            with side.comm() as counts:
                y = x.redistribute(placements=[_placement(side, dst)], async_op=True)
            pending = type(y.to_local()).__name__ == "AsyncCollectiveTensor"
            got = full(y).detach()
            sync = full(x.redistribute(placements=[_placement(side, dst)])).detach()
            y.to_local().mul(2).sum().backward()  # the first op on the shard waits
            assert x.grad is not None
            row[side.name] = {
                "layout": layout(y),
                "counts": counts,
                "pending": pending,
                "value": got,
                "equal_to_sync": torch.equal(got, sync),
                "grad": full(x.grad),
            }
        found.append(row)
    return found


def test_async_redistribute_matches_torch_values_layouts_and_collectives() -> None:
    for rank, rows in enumerate(run_on_ranks(_async_moves, 2, MOVES)):
        for row in rows:
            ours, theirs = row["hp"], row["torch"]
            where = f"rank {rank}, {row['move']}"
            assert ours["layout"] == theirs["layout"], where
            if row["move"].startswith("S0->S1"):  # torch on gloo: all-gather + slice (README)
                assert ours["counts"] == {"all_to_all": 1}, where
            else:
                assert ours["counts"] == theirs["counts"], where
            assert ours["equal_to_sync"], where
            assert torch.equal(ours["value"], theirs["value"]), where
            torch.testing.assert_close(ours["grad"], theirs["grad"], rtol=0, atol=1e-6)
            # a collective whose result is read as is stays pending until first use
            if row["move"].startswith(("S0->R (4", "P->R", "P->S0")):
                assert ours["pending"] and theirs["pending"], where


def test_async_redistribute_on_one_rank_is_the_plain_result() -> None:
    ((row,),) = run_on_ranks(_async_moves, 1, [("P", "R", (4, 6))])
    assert row["hp"]["equal_to_sync"] and not row["hp"]["pending"]
    assert row["hp"]["counts"] == row["torch"]["counts"] == {}

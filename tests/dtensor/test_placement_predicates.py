"""Placement predicates answer as torch's do: is_shard(dim=None), is_partial(reduce_op=None), is_replicate()."""

from __future__ import annotations

import pytest
import torch.distributed.tensor as torch_dt

from hyper_parallel.dtensor import Partial, Placement, Replicate, Shard

PAIRS: list[tuple[Placement, object]] = [
    (Shard(0), torch_dt.Shard(0)),
    (Shard(1), torch_dt.Shard(1)),
    (Shard(-1), torch_dt.Shard(-1)),
    (Replicate(), torch_dt.Replicate()),
    *[(Partial(op), torch_dt.Partial(op)) for op in ("sum", "avg", "max", "min")],
]
IDS = [repr(ours) for ours, _ in PAIRS]


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=IDS)
@pytest.mark.parametrize("dim", [None, 0, 1, -1, 2])
def test_is_shard_with_and_without_dim_matches_torch(
    ours: Placement, theirs: object, dim: int | None
) -> None:
    assert ours.is_shard(dim) == theirs.is_shard(dim)  # type: ignore[attr-defined]
    assert ours.is_shard(dim=dim) == theirs.is_shard(dim=dim)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=IDS)
@pytest.mark.parametrize("reduce_op", [None, "sum", "avg", "max", "min"])
def test_is_partial_with_and_without_reduce_op_matches_torch(
    ours: Placement, theirs: object, reduce_op: str | None
) -> None:
    assert ours.is_partial(reduce_op) == theirs.is_partial(reduce_op)  # type: ignore[attr-defined]
    assert ours.is_partial(reduce_op=reduce_op) == theirs.is_partial(reduce_op=reduce_op)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=IDS)
def test_is_replicate_matches_torch(ours: Placement, theirs: object) -> None:
    assert ours.is_replicate() == theirs.is_replicate()  # type: ignore[attr-defined]

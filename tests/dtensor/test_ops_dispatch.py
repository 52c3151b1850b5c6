"""The dispatcher itself: the decision cache, the fallback for ops without rules, mixed tensors.

* A repeated call reuses its cached decision (no new derivation, cache size stable).
* Ops without a sharding rule (cumprod on a sharded dim, sort, kthvalue, roll, conv1d, ...)
  give the full-tensor results, warn ``FallbackWarning`` once per op and count in
  ``fallback_counts()``; in-place ops that fall back write their result back into
  each mutated DTensor in its own layout (foreach ops included).
* Plain tensors mixed with DTensors raise a ``RuntimeError`` naming the op and the
  argument, unless under ``implicit_replication()``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._op_oracle import OpCase, run_cases

from hyper_parallel.dtensor import (
    DTensor,
    FallbackWarning,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    implicit_replication,
    init_device_mesh,
    plan_cache_size,
    reset_fallback_counts,
)
from hyper_parallel.dtensor._tensor import plan_derivations

_R = Replicate()
_P = Partial()


def _index_put_inplace(t: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.index_put_((i,), v, accumulate=True)
    return out


def _cumsum_inplace(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.cumsum_(0)
    return out


def fallback_cases() -> list[OpCase]:
    """Unusual ops: those without a rule must fall back (``rule=False``) and stay correct."""
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(5, 6, generator=gen)
    y = torch.randn(5, 6, generator=gen)
    signal = torch.randn(2, 3, 9, generator=gen)
    kernel = torch.randn(4, 3, 3, generator=gen)
    every = [(Shard(0),), (Shard(1),), (_R,), (_P,)]
    return [
        OpCase(
            "cumprod_sharded_dim",
            lambda t: torch.cumprod(t, 0),
            (x,),
            [(Shard(0),), (_P,)],
            rule=False,
        ),
        OpCase("cumsum_inplace", _cumsum_inplace, (x,), [(Shard(0),), (Shard(1),)], rule=False),
        OpCase("sort", lambda t: torch.sort(t, dim=1), (x,), every, rule=False),
        OpCase("kthvalue", lambda t: torch.kthvalue(t, 3, dim=0), (x,), every, rule=False),
        OpCase(
            "conv1d",
            F.conv1d,
            (signal, kernel),
            [(Shard(0), _R), (Shard(1), Shard(1)), (_R, Shard(0))],
            rule=False,
        ),
        # these have rules (or decompose into ops that do); either way: oracle-equal
        OpCase("roll", lambda t: torch.roll(t, 1, 0), (x,), every, rule=True),
        OpCase(
            "index_put_",
            _index_put_inplace,
            (x, torch.tensor([0, 4, 0]), torch.randn(3, 6, generator=gen)),
            [(Shard(1), _R, Shard(1)), (Shard(0), _R, _R), (_R, _R, Shard(0))],
            rule=None,
        ),
        OpCase(
            "einsum",
            lambda s, t: torch.einsum("ij,kj->ik", s, t),
            (x, y),
            [(Shard(0), _R), (Shard(1), Shard(1))],
            rule=None,
        ),
        OpCase(
            "where_mask",
            lambda s, t: torch.where(s > 0, s, t),
            (x, y),
            [(Shard(0), Shard(1)), (_R, Shard(0))],
            rule=None,
        ),
    ]


@world_sizes(2, 4)
def test_ops_without_rules_fall_back_to_correct_results(world_size: int) -> None:
    report = run_cases(fallback_cases, world_size)
    for op in (
        "aten.cumprod.default",
        "aten.sort.default",
        "aten.kthvalue.default",
    ):
        assert report.fallbacks.get(op, 0) > 0, f"{op} did not fall back: {report.fallbacks}"


# -- warnings, counters, in-place write-back ---------------------------------------------


def _fallback_bookkeeping(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(24.0).reshape(6, 4)
    x = distribute_tensor(full, mesh, [Shard(0)])
    reset_fallback_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = torch.cumprod(x, 0)
        second = torch.cumprod(x, 0)
    assert isinstance(first, DTensor) and isinstance(second, DTensor)
    fallback_warnings = [w for w in caught if issubclass(w.category, FallbackWarning)]

    inplace = distribute_tensor(full, mesh, [Shard(1)])
    inplace.cumsum_(0)  # falls back; the result goes back into the Shard(1) shards
    partial = DTensor.from_local(full / world_size, mesh, [_P])
    partial.cumsum_(1)  # an in-place fallback writes its result back as Partial too

    a = distribute_tensor(full, mesh, [Shard(0)])
    b = distribute_tensor(full * 2, mesh, [Replicate()])
    torch._foreach_mul_([a, b], 3.0)
    return {
        "first": first.full_tensor(),
        "second": second.full_tensor(),
        "first_placements": first.placements,
        "warnings": [str(w.message) for w in fallback_warnings],
        "counts": fallback_counts(),
        "inplace": (inplace.full_tensor(), inplace.placements),
        "partial": (partial.full_tensor(), partial.placements),
        "foreach": (a.full_tensor(), a.placements, b.full_tensor(), b.placements),
    }


@pytest.mark.allows_fallback
@world_sizes(2)
def test_fallback_warns_once_counts_every_call_and_writes_back_in_place(world_size: int) -> None:
    got = run_on_ranks(_fallback_bookkeeping, world_size, world_size)[0]
    full = torch.arange(24.0).reshape(6, 4)
    torch.testing.assert_close(got["first"], torch.cumprod(full, 0))
    torch.testing.assert_close(got["second"], torch.cumprod(full, 0))
    assert got["first_placements"] == (Replicate(),)
    assert len(got["warnings"]) == 1 and "aten.cumprod.default" in got["warnings"][0]
    assert got["counts"]["aten.cumprod.default"] == 2
    assert got["counts"]["aten.cumsum_.default"] == 2
    torch.testing.assert_close(got["inplace"][0], torch.cumsum(full, 0))
    assert got["inplace"][1] == (Shard(1),)
    torch.testing.assert_close(got["partial"][0], torch.cumsum(full, 1))
    assert got["partial"][1] == (_P,)
    a, a_placements, b, b_placements = got["foreach"]
    torch.testing.assert_close(a, full * 3)
    torch.testing.assert_close(b, full * 6)
    assert a_placements == (Shard(0),) and b_placements == (Replicate(),)


# -- the decision cache ------------------------------------------------------------------


def _cache_behaviour(world_size: int) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    w = distribute_tensor(torch.randn(3, 6), mesh, [Shard(0)])

    def step() -> None:
        F.linear(x + y, w).sum()

    step()
    size, derived = plan_cache_size(), plan_derivations()
    for _ in range(3):
        step()
    repeat = (plan_cache_size() - size, plan_derivations() - derived)
    x * 0.5
    derived = plan_derivations()
    x * 0.25  # another float value of a pointwise op: same decision
    float_value = plan_derivations() - derived
    other = x.redistribute(placements=[Replicate()])
    derived = plan_derivations()
    other + y  # another layout: a new decision
    new_layout = plan_derivations() - derived
    return {
        "repeat_size": repeat[0],
        "repeat_derived": repeat[1],
        "float_value": float_value,
        "new_layout": new_layout,
    }


@world_sizes(2)
def test_repeated_calls_hit_the_decision_cache(world_size: int) -> None:
    got = run_on_ranks(_cache_behaviour, world_size, world_size)[0]
    assert got["repeat_size"] == 0 and got["repeat_derived"] == 0, got
    assert got["float_value"] == 0, got
    assert got["new_layout"] == 1, got


# -- plain tensors mixed with DTensors ---------------------------------------------------


def _mixing(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(4, 6)
    plain = torch.randn(4, 6)
    x = distribute_tensor(full, mesh, [Shard(0)])
    result: dict[str, Any] = {}
    try:
        x + plain
    except RuntimeError as exc:
        result["error"] = str(exc)
    try:
        torch.cat([x, plain])
    except RuntimeError as exc:
        result["list_error"] = str(exc)
    with implicit_replication():
        implicit = x + plain
    scaled = x * torch.tensor(2.0)
    assert isinstance(implicit, DTensor) and isinstance(scaled, DTensor)
    result["implicit"] = implicit.full_tensor()
    result["scalar_tensor"] = scaled.full_tensor()
    other_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    z = distribute_tensor(full, other_mesh, [Shard(0)])
    try:
        x + z
    except ValueError as exc:
        result["mesh_error"] = str(exc)
    result["expected_implicit"] = full + plain
    result["expected_scalar"] = full * 2
    return result


@world_sizes(2)
def test_mixing_plain_tensors_names_op_and_argument(world_size: int) -> None:
    got = run_on_ranks(_mixing, world_size, world_size)[0]
    assert "aten.add.Tensor" in got["error"] and "argument 1 ('other')" in got["error"]
    assert "implicit_replication" in got["error"]
    assert "aten.cat.default" in got["list_error"] and "argument 0 ('tensors')" in got["list_error"]
    torch.testing.assert_close(got["implicit"], got["expected_implicit"])
    torch.testing.assert_close(got["scalar_tensor"], got["expected_scalar"])
    assert "different meshes" in got["mesh_error"]

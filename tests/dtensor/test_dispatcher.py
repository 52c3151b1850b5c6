"""The dispatcher object: its registry, strict mode, a failing rule, declared in-kernel reductions.

* A ``Dispatcher`` is built for a DTensor class and holds its rule registry: a class
  with a registry of its own dispatches by it, and a rule registered after a call is
  seen by the next call.
* A rule that raises is a bug: its error reaches the caller. Only "no rule" and "the
  rule declined" (``None`` or ``Declined``) take the fallback.
* Under ``strict_mode()`` (the test suite runs with ``HYPER_PARALLEL_STRICT=1``) a
  fallback raises ``FallbackError``; ``strict_mode(False)`` allows it again.
* ``explain`` shows a rule's moves, its output placements and the in-kernel reductions
  the rule declares (``Decision.reduces``), which the cost includes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks, world_sizes

from hyper_parallel.dtensor import (
    DTensor,
    FallbackError,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
    strict_mode,
)
from hyper_parallel.dtensor._dispatch import Dispatcher, detach_alias
from hyper_parallel.dtensor._registry import Decision, Declined, OpCall, RuleRegistry
from hyper_parallel.dtensor._spec import DTensorSpec
from hyper_parallel.dtensor.debug import explain

aten = torch.ops.aten


class _Probe(DTensor):
    """A DTensor class with a dispatcher and a registry of its own (only ``add``)."""

    __slots__ = ()


_probe_rules = RuleRegistry()
_Probe._op_dispatcher = Dispatcher(_Probe, _probe_rules)


def _probe(t: torch.Tensor, like: DTensor) -> _Probe:
    return _Probe(t, like._spec)


def _registry_and_rule_errors(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    a, b = _probe(x.to_local(), x), _probe(x.to_local() * 2, x)
    got: dict[str, Any] = {}

    with strict_mode():  # no rule for add in the probe's registry: a fallback
        try:
            a + b
        except FallbackError as exc:
            got["no_rule"] = str(exc)

    def raising(call: OpCall) -> Decision:
        raise ZeroDivisionError("a bug in the rule")

    _probe_rules.register_rule(aten.add.Tensor)(raising)  # seen by the next call
    try:
        a + b
    except ZeroDivisionError as exc:
        got["raised"] = str(exc)

    def declining(call: OpCall) -> Decision:
        raise Declined("only Replicate inputs")

    _probe_rules.register_rule(aten.add.Tensor)(declining)
    with strict_mode(False):
        before = fallback_counts().get("aten.add.Tensor", 0)
        out: Any = a + b
        got["declined_value"] = out.full_tensor().tolist()
        got["declined_placements"] = out.placements
        got["fallback_counted"] = _Probe._op_dispatcher.fallbacks["aten.add.Tensor"]
        got["main_counts_untouched"] = fallback_counts().get("aten.add.Tensor", 0) - before
    with strict_mode():
        try:
            a + b
        except FallbackError as exc:
            got["declined_strict"] = str(exc)

    def shard_local(call: OpCall) -> Decision:
        return Decision([s.placements for s in call.specs], [call.specs[0].placements])

    _probe_rules.register_rule(aten.add.Tensor)(shard_local)
    with strict_mode():
        out = a + b
        assert isinstance(out, _Probe)
        got["ruled_placements"] = out.placements
        got["ruled_value"] = out.full_tensor().tolist()
        got["type"] = type(out).__name__
    got["env_strict"] = os.environ.get("HYPER_PARALLEL_STRICT")
    return got


@world_sizes(2)
def test_registry_strict_mode_and_failing_rules(world_size: int) -> None:
    got = run_on_ranks(_registry_and_rule_errors, world_size, world_size)[0]
    full = torch.arange(8.0).reshape(4, 2)
    assert "aten.add.Tensor" in got["no_rule"] and "no sharding rule" in got["no_rule"], got
    assert got["raised"] == "a bug in the rule", got
    assert got["declined_value"] == (full * 3).tolist(), got
    assert got["declined_placements"] == (Replicate(),), got
    assert got["fallback_counted"] == 1 and got["main_counts_untouched"] == 0, got
    assert "only Replicate inputs" in got["declined_strict"], got
    assert got["ruled_placements"] == (Shard(0),), got
    assert got["ruled_value"] == (full * 3).tolist(), got
    assert got["type"] == "_Probe", got
    assert got["env_strict"] == "1", got  # the suite runs strict (tests/conftest.py)


def _explained(world_size: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    w = distribute_tensor(torch.randn(6, 3), mesh, [Replicate()])
    with strict_mode(False):
        return {
            "mm": explain(aten.mm.default, x, w),
            "softmax": explain(aten._softmax.default, x, 1, False),
            "sort": explain(aten.sort.default, x, 1),
        }


@world_sizes(2)
def test_explain_shows_moves_and_in_kernel_reductions(world_size: int) -> None:
    got = run_on_ranks(_explained, world_size, world_size)[0]
    # x Shard(1) @ w Replicate: w is sliced to Shard(0), the product is Partial, no bytes move
    assert "input 1: (Replicate(),) -> (Shard(dim=0),)" in got["mm"], got["mm"]
    assert "output 0: (Partial(" in got["mm"], got["mm"]
    # a softmax over the sharded dim all-reduces inside its kernel: declared and costed
    assert "in-kernel all-reduce over mesh axes (0,)" in got["softmax"], got["softmax"]
    assert "estimated bytes sent per rank: 0\n" not in got["softmax"] + "\n", got["softmax"]
    assert got["sort"].startswith("aten.sort.default: fallback"), got["sort"]


def test_bool_and_int_arguments_key_apart() -> None:
    """``True == 1`` in Python; the cache key tells them apart (their plans differ in dtype)."""
    key = DTensor._op_dispatcher.key
    assert key((True, 2.5), [], False) != key((1, 2.5), [], False)
    assert key((2.5,), [], True) == key((0.5,), [], True)  # floats by type
    assert key(([1, 2], (3, True)), [], False) == ((1, 2), (3, ("bool", True)))


def _keys_agree(world_size: int) -> list[str]:
    """After each call, its plan is cached under ``cache_key`` (the keying ``dispatch`` inlines)."""
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    dispatcher = DTensor._op_dispatcher
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (aten.add.Tensor, (x, y), {}),
        (aten.add.Tensor, (x, y), {"alpha": 2}),
        (aten.mul.Tensor, (x, 0.5), {}),
        (aten.add.Tensor, (x, True), {}),
        (aten.view.default, (y, [6, 4]), {}),
        (aten.sum.dim_IntList, (x, [1], True), {}),
        (aten.cat.default, ([x, x], 1), {}),
        (aten.mul.Tensor, (x, torch.tensor(2.0)), {}),
        (aten._foreach_add.List, ([x, y], [y, y]), {}),
    ]
    calls += [  # positional DTensors and scalars only: the fast path of a cache hit
        (aten.add.Tensor, (x, x), {}),
        (aten.mul.Tensor, (x, 2), {}),
        (aten.add.Tensor, (y, False), {}),
        (aten.clone.default, (y,), {}),
        (aten.t.default, (y,), {}),
        (aten.transpose.int, (x, 0, 1), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.float64}),
        # scalar keywords key inline too, by name
        (aten.clone.default, (x,), {"memory_format": torch.contiguous_format}),
        (aten.add.Tensor, (x, y), {"alpha": 0.5}),
        # lists of DTensors and of floats (an optimizer's foreach ops) key inline too
        (aten._foreach_mul.ScalarList, ([x, y], [0.5, 2.0]), {}),
        (aten._foreach_addcmul.Scalar, ([x, y], [y, y], [x, y], 0.5), {}),
        (aten._foreach_mul_.Scalar, ([x.clone(), y.clone()], 2.0), {}),
        (aten._foreach_lerp_.Scalar, ([x.clone()], [y], 0.25), {}),
    ]
    missing = []
    for func, args, kwargs in calls:
        first = dispatcher.dispatch(func, args, kwargs, specials=False)
        if dispatcher.cache_key(func, args, kwargs) not in dispatcher.op_info(func).plans:
            missing.append(f"{func} {args!r:.60} {kwargs}")
        # the second call hits the cache (by the fast path where it applies): no new
        # derivation, and the general path's result
        derived = dispatcher.derivations
        second = dispatcher.dispatch(func, args, kwargs, specials=False)
        if dispatcher.derivations != derived:
            missing.append(f"re-derived: {func} {args!r:.60} {kwargs}")
        for a, b in zip(_tensors(first), _tensors(second), strict=True):
            if a._spec != b._spec or not torch.equal(a._local_tensor, b._local_tensor):
                missing.append(f"results differ: {func} {args!r:.60} {kwargs}")
    # an equal spec of another object hits the plan filed for the first (compared by
    # value), and gives its result
    twin = DTensor(
        x._local_tensor, DTensorSpec(x._spec.mesh, x._spec.placements, x._spec.tensor_meta)
    )
    assert twin._spec is not x._spec
    derived = dispatcher.derivations
    got = dispatcher.dispatch(aten.mul.Tensor, (twin, y), {})
    want = dispatcher.dispatch(aten.mul.Tensor, (x, y), {})
    if dispatcher.derivations - derived > 1 or got._spec != want._spec:
        missing.append("an equal spec of another object re-derived or differs")
    if not torch.equal(got._local_tensor, want._local_tensor):
        missing.append("an equal spec of another object: values differ")
    # detach, run inline, is its registered special (detach_alias)
    inline = x.detach()
    special = detach_alias(aten.detach.default, (x,), {})
    assert isinstance(inline, DTensor) and isinstance(special, DTensor)
    if not (
        type(inline) is type(special)
        and inline._spec is special._spec is x._spec
        and torch.equal(inline._local_tensor, special._local_tensor)
        and inline._local_tensor.data_ptr() == x._local_tensor.data_ptr()
        and not inline.requires_grad
        and inline is not x
    ):
        missing.append("detach inline differs from detach_alias")
    return missing


def _tensors(value: Any) -> list[DTensor]:
    if isinstance(value, DTensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@world_sizes(2)
def test_inline_keying_agrees_with_cache_key(world_size: int) -> None:
    assert run_on_ranks(_keys_agree, world_size, world_size)[0] == []


@pytest.mark.allows_fallback
def test_the_allows_fallback_mark_lifts_strict_mode() -> None:
    assert os.environ["HYPER_PARALLEL_STRICT"] == "0"

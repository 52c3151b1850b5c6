"""Optimizer steps and clip_grad_norm_ on DTensor parameters equal the one-process steps.

Oracle: the same optimizer on plain full tensors with the same gradients, in the
same process. Parameters are sharded on dim 0, dim 1 (uneven on 4 ranks) or
replicated; gradients come laid out like their parameter or as Partial(sum)
(rank 0 holds the whole value, the others zeros, so the sum is exact).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tests._harness import run_on_ranks

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
)
from hyper_parallel.dtensor._tensor import plan_derivations

SHAPES_AND_PLACEMENTS: list[tuple[tuple[int, ...], Placement]] = [
    ((8, 6), Shard(0)),
    ((6, 10), Shard(1)),  # 10 columns: 3, 3, 3, 1 on 4 ranks
    ((5,), Replicate()),
    ((7, 3), Shard(0)),
]
Make = Callable[[list[torch.Tensor], bool], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=fe),
    "adamw_amsgrad": lambda ps, fe: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=fe),
    "sgd_momentum": lambda ps, fe: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=fe
    ),
    "sgd_nesterov": lambda ps, fe: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, foreach=fe
    ),
}
TOLERANCE = 1e-6


def _full_values(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape, _ in SHAPES_AND_PLACEMENTS]


def _as_grad(full: torch.Tensor, mesh: DeviceMesh, placement: Placement, partial: bool) -> DTensor:
    if partial:
        local = full.clone() if mesh.get_rank() == 0 else torch.zeros_like(full)
        return DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)
    return distribute_tensor(full, mesh, [placement] * mesh.ndim, src_data_rank=None)


def _full(t: torch.Tensor) -> torch.Tensor:
    assert isinstance(t, DTensor), f"expected a DTensor, found {type(t).__name__}"
    return t.full_tensor().detach()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _optimizer_steps_match(mesh_shape: tuple[int, ...]) -> list[str]:
    mesh = init_device_mesh("cpu", mesh_shape)
    failures: list[str] = []
    before = fallback_counts()
    for name, make in OPTIMIZERS.items():
        for foreach in (True, False):
            for partial_grads in (False, True):
                if partial_grads and not foreach:
                    continue  # the single-tensor path is the pointwise rules' business
                where = f"{name} foreach={foreach} partial_grads={partial_grads}"
                ref = [p.clone().requires_grad_() for p in _full_values(1)]
                dts = [
                    distribute_tensor(
                        p.detach(), mesh, [pl] * mesh.ndim, src_data_rank=None
                    ).requires_grad_()
                    for p, (_, pl) in zip(ref, SHAPES_AND_PLACEMENTS, strict=True)
                ]
                placements = [d.placements for d in dts]
                opt_ref, opt_dt = make(ref, foreach), make(list(dts), foreach)
                for step in range(3):
                    grads = _full_values(100 + step)
                    for p, d, g, (_, pl) in zip(
                        ref, dts, grads, SHAPES_AND_PLACEMENTS, strict=True
                    ):
                        p.grad = g.clone()
                        d.grad = _as_grad(g, mesh, pl, partial_grads)
                    opt_ref.step()
                    opt_dt.step()
                    for i, (p, d) in enumerate(zip(ref, dts, strict=True)):
                        diff = _max_diff(_full(d), p.detach())
                        if diff > TOLERANCE:
                            failures.append(f"{where} step {step} param {i}: max diff {diff}")
                        if d.placements != placements[i]:
                            failures.append(
                                f"{where} param {i}: placements moved {placements[i]} -> {d.placements}"
                            )
    failures += _foreach_layouts(mesh)
    after = fallback_counts()
    fell_back = {op: n for op, n in after.items() if n != before.get(op, 0)}
    if fell_back:
        failures.append(f"ops fell back during the steps: {fell_back}")
    return failures


def _placements(t: torch.Tensor) -> tuple[Placement, ...]:
    assert isinstance(t, DTensor)
    return t.placements


def _foreach_layouts(mesh: DeviceMesh) -> list[str]:
    """In-place foreach ops on lists laid out like self (run on the local lists, no plan)
    and on lists laid out otherwise (Replicate or Shard(1) against a Shard(0) self, a
    Partial self: the rule's path) equal the ops on full tensors; selves keep their layout."""
    failures: list[str] = []
    n = mesh.ndim
    a, b, c = _full_values(7)[0], _full_values(8)[0], _full_values(9)[0]  # (8, 6) each
    cases = {
        "equal layouts": (Shard(0), Shard(0), Shard(0)),
        "Replicate and Shard(1) others": (Shard(0), Replicate(), Shard(1)),
        "Partial self": (Partial(), Shard(0), Shard(0)),
    }
    for extra, (where, (self_pl, pl1, pl2)) in enumerate(cases.items(), start=1):
        # 8 + extra rows: a layout no plan has seen yet
        full_a, full_b, full_c = (torch.cat([t, t[:extra]]) for t in (a, b, c))
        selves: list[torch.Tensor]
        if self_pl == Partial():
            local = full_a.clone() if mesh.get_rank() == 0 else torch.zeros_like(full_a)
            selves = [DTensor.from_local(local, mesh, [Partial()] * n)]
        else:
            selves = [distribute_tensor(full_a, mesh, [self_pl] * n, src_data_rank=None)]
        others: list[torch.Tensor] = [
            distribute_tensor(full_b, mesh, [pl1] * n, src_data_rank=None)
        ]
        thirds: list[torch.Tensor] = [
            distribute_tensor(full_c, mesh, [pl2] * n, src_data_rank=None)
        ]
        derived = plan_derivations()
        torch._foreach_mul_(selves, 0.5)
        torch._foreach_add_(selves, others, alpha=2.0)
        torch._foreach_addcmul_(selves, others, thirds, 0.25)
        torch._foreach_lerp_(selves, thirds, 0.3)
        expected = torch.lerp(
            torch.addcmul(full_a * 0.5 + 2.0 * full_b, full_b, full_c, value=0.25), full_c, 0.3
        )
        diff = _max_diff(_full(selves[0]), expected)
        if diff > TOLERANCE:
            failures.append(f"foreach {where}: max diff {diff}")
        if where == "equal layouts":
            if plan_derivations() != derived:
                failures.append("foreach equal layouts: planned instead of running on the locals")
            if _placements(selves[0]) != (Shard(0),) * n:
                failures.append(f"foreach {where}: self moved to {_placements(selves[0])}")
        elif where != "Partial self" and _placements(selves[0]) != (self_pl,) * n:
            failures.append(f"foreach {where}: self moved to {_placements(selves[0])}")
    return failures


def test_optimizer_steps_match_one_process_on_two_ranks() -> None:
    assert run_on_ranks(_optimizer_steps_match, 2, (2,), timeout_s=240)[0] == []


def test_optimizer_steps_match_one_process_on_four_ranks() -> None:
    results = run_on_ranks(_optimizer_steps_match, 4, (4,), timeout_s=240)
    assert results[0] == [] and results[3] == []


def _clip_grad_norm_matches(mesh_shape: tuple[int, ...]) -> list[str]:
    mesh = init_device_mesh("cpu", mesh_shape)
    failures: list[str] = []
    before = fallback_counts()
    for foreach in (True, False):
        for norm_type in (2.0, float("inf"), 3.0):
            where = f"clip foreach={foreach} norm_type={norm_type}"
            grads = _full_values(7)
            ref = [torch.zeros_like(g, requires_grad=True) for g in grads]
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            dts = []
            for g, (_, pl) in zip(grads, SHAPES_AND_PLACEMENTS, strict=True):
                d = distribute_tensor(torch.zeros_like(g), mesh, [pl] * mesh.ndim).requires_grad_()
                d.grad = _as_grad(g, mesh, pl, partial=False)
                dts.append(d)
            expected = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type, foreach=foreach)
            calls: list[tuple[str, int, int]] = []

            def record(
                r: collectives.CollectiveRecord, calls: list[tuple[str, int, int]] = calls
            ) -> None:
                calls.append((r.kind, r.nbytes, r.group_size))

            with collectives.observe_collectives(record):
                got = torch.nn.utils.clip_grad_norm_(dts, 0.5, norm_type, foreach=foreach)
            got_value = got.full_tensor() if isinstance(got, DTensor) else got
            if abs(float(got_value) - float(expected)) > TOLERANCE * max(1.0, float(expected)):
                failures.append(f"{where}: norm {float(got_value)} != {float(expected)}")
            for i, (p, d) in enumerate(zip(ref, dts, strict=True)):
                assert d.grad is not None and p.grad is not None
                diff = _max_diff(_full(d.grad), p.grad)
                if diff > TOLERANCE:
                    failures.append(f"{where}: grad {i} max diff {diff}")
            if foreach:
                sharded = sum(1 for _, pl in SHAPES_AND_PLACEMENTS if isinstance(pl, Shard))
                expected_calls = [
                    ("all_reduce", 4 * sharded, mesh.size(axis))
                    for axis in range(mesh.ndim)
                    if mesh.size(axis) > 1
                ]
                if calls != expected_calls:
                    failures.append(f"{where}: collectives {calls}, expected {expected_calls}")
    after = fallback_counts()
    fell_back = {op: n for op, n in after.items() if n != before.get(op, 0)}
    if fell_back:
        failures.append(f"ops fell back during clip_grad_norm_: {fell_back}")
    return failures


def test_clip_grad_norm_returns_global_norm_and_scales_like_one_device() -> None:
    assert run_on_ranks(_clip_grad_norm_matches, 2, (2,), timeout_s=240)[0] == []


def test_clip_grad_norm_one_small_all_reduce_per_mesh_axis_on_2x2() -> None:
    results = run_on_ranks(_clip_grad_norm_matches, 4, (2, 2), timeout_s=240)
    assert results[0] == [] and results[3] == []

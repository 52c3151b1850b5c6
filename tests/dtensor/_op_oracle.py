"""Op oracle: run an op on DTensors and compare outputs and gradients with the op on full tensors.

A :class:`OpCase` names an op (a callable), full input tensors and a list of layouts
(one placement per tensor input). :func:`check_cases` runs, on every rank and for
every layout: the op on full tensors in this process (the oracle), the op on
DTensors laid out as the layout says, and (where it supports the case) the op on
``torch.distributed.tensor`` DTensors. Forward output and every input gradient are
compared as full tensors. The loss of the backward pass is the sum of every
floating output times a fixed random tensor. Failures are returned as messages,
so one launch reports every broken case.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from tests._harness import TEST_DEVICE
from tests._tolerance import scaled_atol
from torch.distributed.device_mesh import DeviceMesh as TorchMesh

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    fallback_counts,
    init_device_mesh,
    strict_mode,
)
from hyper_parallel.dtensor._spec import chunk_range, local_shape_and_offset

__all__ = [
    "LayoutItem",
    "OpCase",
    "check_cases",
    "make_meshes",
    "rand_shape",
    "shard_layouts",
]

LayoutItem = Placement | tuple[Placement, ...]
"""One input's layout: a placement for a 1-D mesh, or one placement per mesh axis."""

_R = Replicate()


@dataclass(frozen=True)
class OpCase:
    """One op with its full inputs and the layouts to try.

    ``inputs`` holds the op's positional arguments: tensors become DTensors (the
    floating ones require grad when ``grad`` is set); other values pass through.
    Each layout has one item per tensor input. ``rule`` says whether the op must
    run through sharding rules (no fallback); ``None`` accepts either.
    """

    name: str
    fn: Callable[..., Any]
    inputs: tuple[Any, ...]
    layouts: Sequence[tuple[LayoutItem, ...]]
    grad: bool = True
    rule: bool | None = True
    atol: float = 1e-5
    rtol: float = 1e-4
    torch_check: bool = True
    no_grad: tuple[int, ...] = ()  # tensor inputs (by position among tensors) left without grad


@dataclass
class Report:
    """What :func:`check_cases` found on one rank."""

    failures: list[str] = field(default_factory=list)
    checked: int = 0
    torch_checked: int = 0
    torch_unsupported: list[str] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)


def make_meshes(
    mesh_shape: tuple[int, ...], *, with_torch: bool
) -> tuple[DeviceMesh, TorchMesh | None]:
    """Our mesh and (``with_torch``) torch's, over the same ranks (collective).

    Importing ``torch.distributed.tensor`` costs seconds per rank process, so the
    torch comparison is opt-in.
    """
    ours = init_device_mesh(TEST_DEVICE, mesh_shape)
    if not with_torch:
        return ours, None
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    return ours, torch_init_device_mesh(TEST_DEVICE, mesh_shape)


def rand_shape(gen: torch.Generator, ndim: int, low: int = 1, high: int = 7) -> tuple[int, ...]:
    """A random shape with sizes in ``[low, high)`` (odd sizes give uneven shards)."""
    return tuple(int(v) for v in torch.randint(low, high, (ndim,), generator=gen))


def shard_layouts(ndim: int, *, partial: bool = False) -> list[LayoutItem]:
    """Shard of each dim, Replicate, and (when the op is linear) Partial."""
    items: list[LayoutItem] = [Shard(d) for d in range(ndim)]
    items.append(_R)
    if partial:
        items.append(Partial())
    return items


def _axis_layouts(
    layouts: Sequence[tuple[LayoutItem, ...]], mesh_ndim: int
) -> list[tuple[tuple[Placement, ...], ...]]:
    """Expand 1-D layouts to the mesh: on a 2-D mesh, layout i on axis 0 and i+1 on axis 1."""
    out: list[tuple[tuple[Placement, ...], ...]] = []
    n = len(layouts)
    for i, layout in enumerate(layouts):
        if any(isinstance(item, tuple) for item in layout):
            if all(isinstance(item, tuple) and len(item) == mesh_ndim for item in layout):
                out.append(tuple(item for item in layout if isinstance(item, tuple)))
            continue
        if mesh_ndim == 1:
            out.append(tuple((item,) for item in layout if isinstance(item, Placement)))
        else:
            nxt = layouts[(i + 1) % n]
            if any(isinstance(item, tuple) for item in nxt):
                nxt = layout
            per_input: list[tuple[Placement, ...]] = []
            for a, b in zip(layout, nxt, strict=True):
                assert isinstance(a, Placement) and isinstance(b, Placement)
                per_input.append((a, b) + (b,) * (mesh_ndim - 2))
            out.append(tuple(per_input))
    return out


def _local_piece(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    seed: int,
) -> torch.Tensor:
    """This rank's piece of ``full``: shards sliced outer axis first, partials split randomly."""
    piece = full
    for axis, p in enumerate(placements):
        n, c = mesh_shape[axis], coordinate[axis]
        if isinstance(p, Shard):
            start, length = chunk_range(piece.shape[p.dim], n, c)
            piece = piece.narrow(p.dim, start, length)
        elif isinstance(p, Partial):
            gen = torch.Generator().manual_seed(seed * 31 + axis)
            noise = [torch.randn(piece.shape, generator=gen).to(piece.dtype) for _ in range(n)]
            if p.reduce_op in ("sum", "avg"):
                scale = n if p.reduce_op == "avg" else 1
                rest = piece - sum(noise[:-1], torch.zeros_like(piece))
                piece = (noise[c] if c < n - 1 else rest) * scale
            else:
                sign = -1.0 if p.reduce_op == "max" else 1.0
                piece = piece if c == 0 else piece + sign * (noise[c].abs() + 0.5)
    return piece.clone().contiguous()


def _to_torch_placement(p: Placement) -> Any:
    import torch.distributed.tensor as tdt

    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    if isinstance(p, Partial):
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _flat(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        flat: list[Any] = []
        for o in out:
            flat.extend(_flat(o))
        return flat
    return [out]


def _weights(outs: list[Any], seed: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    result: list[torch.Tensor | None] = []
    for o in outs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            result.append(torch.randn(tuple(o.shape), generator=gen).to(o.dtype))
        else:
            result.append(None)
    return result


def _run(
    case: OpCase,
    tensors: list[torch.Tensor],
    full_of: Callable[[Any], torch.Tensor],
    seed: int,
) -> tuple[list[Any], list[torch.Tensor | None], list[Any]]:
    """Run the op with ``tensors`` substituted; return full outputs, input grads, raw outputs."""
    it = iter(tensors)
    args = [next(it) if isinstance(a, torch.Tensor) else a for a in case.inputs]
    out = case.fn(*args)
    outs = _flat(out)
    fulls = [full_of(o) if isinstance(o, torch.Tensor) else o for o in outs]
    loss: torch.Tensor | None = None
    if case.grad:
        for f, w in zip(fulls, _weights(fulls, seed), strict=True):
            if w is not None and isinstance(f, torch.Tensor) and f.requires_grad:
                term = (f * w).sum()
                loss = term if loss is None else loss + term
    if loss is not None:
        torch.autograd.backward(loss)
    grads = [None if t.grad is None else full_of(t.grad) for t in tensors]
    return [f.detach() if isinstance(f, torch.Tensor) else f for f in fulls], grads, outs


def _compare(what: str, got: Sequence[Any], want: Sequence[Any], case: OpCase) -> list[str]:
    problems: list[str] = []
    if len(got) != len(want):
        return [f"{what}: {len(got)} values, expected {len(want)}"]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, torch.Tensor) or isinstance(g, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)):
                problems.append(
                    f"{what}[{i}]: found {type(g).__name__}, expected {type(w).__name__}"
                )
                continue
            try:
                # The absolute part grows with the tensor's scale: reordered sums of large
                # values differ by more than case.atol on some CPUs' kernels.
                atol = max(case.atol, scaled_atol(w, case.rtol))
                torch.testing.assert_close(g, w, atol=atol, rtol=case.rtol, equal_nan=True)
            except AssertionError as exc:
                problems.append(
                    f"{what}[{i}]: {str(exc).splitlines()[0]} {str(exc).splitlines()[-1]}"
                )
        elif g != w and not (isinstance(g, float) and math.isnan(g) and math.isnan(w)):
            problems.append(f"{what}[{i}]: found {g!r}, expected {w!r}")
    return problems


def _our_full(t: Any) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.full_tensor().cpu()  # compared with the one-process oracle on the CPU
    raise TypeError(f"expected a DTensor output, found {type(t).__name__}")


def _torch_full(t: Any) -> torch.Tensor:
    import torch.distributed.tensor as tdt

    if isinstance(t, tdt.DTensor):
        return t.full_tensor().cpu()
    raise TypeError(f"expected a torch DTensor output, found {type(t).__name__}")


def _check_local_shapes(outs: list[Any]) -> list[str]:
    problems: list[str] = []
    for i, o in enumerate(outs):
        if isinstance(o, DTensor):
            spec = o._spec
            coordinate = spec.mesh.get_coordinate()
            assert coordinate is not None
            want, _ = local_shape_and_offset(
                spec.shape, spec.mesh.shape, coordinate, spec.placements
            )
            if tuple(o._local_tensor.shape) != want:
                problems.append(
                    f"output[{i}]: local shard shape {tuple(o._local_tensor.shape)}, its spec "
                    f"{spec.placements} of {spec.shape} says {want}"
                )
    return problems


MakeLeaf = Callable[[torch.Tensor, int], torch.Tensor]


def _leaves(case: OpCase, make: MakeLeaf) -> list[torch.Tensor]:
    """The case's tensor inputs made by ``make(full, index)``; floating ones require grad."""
    out: list[torch.Tensor] = []
    for k, t in enumerate(a for a in case.inputs if isinstance(a, torch.Tensor)):
        leaf = make(t, k)
        if case.grad and t.is_floating_point() and k not in case.no_grad:
            leaf.requires_grad_(True)
        out.append(leaf)
    return out


def _plain_leaf(t: torch.Tensor, k: int) -> torch.Tensor:
    return t.detach().clone()


def _plain_full(t: Any) -> torch.Tensor:
    assert isinstance(t, torch.Tensor)
    return t


def _our_leaf(
    mesh: DeviceMesh, layout: Sequence[tuple[Placement, ...]], seed: int, t: torch.Tensor, k: int
) -> torch.Tensor:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = _local_piece(t, mesh.shape, coordinate, layout[k], seed + k).to(TEST_DEVICE)
    return DTensor.from_local(local, mesh, layout[k], shape=t.shape, stride=t.stride()).detach()


def _torch_leaf(
    mesh: TorchMesh, layout: Sequence[tuple[Placement, ...]], seed: int, t: torch.Tensor, k: int
) -> torch.Tensor:
    import torch.distributed.tensor as tdt

    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = _local_piece(t, mesh.shape, coordinate, layout[k], seed + k).to(TEST_DEVICE)
    placements = [_to_torch_placement(p) for p in layout[k]]
    dt = tdt.DTensor.from_local(local, mesh, placements, shape=t.shape, stride=t.stride())
    return dt.detach()


def check_cases(
    cases: Sequence[OpCase], mesh: DeviceMesh, torch_mesh: TorchMesh | None = None
) -> Report:
    """Run every case on every layout; return the failures (same on every rank)."""
    report = Report()
    for case_index, case in enumerate(cases):
        seed = 1000 + case_index
        try:
            want_out, want_grads, _ = _run(case, _leaves(case, _plain_leaf), _plain_full, seed)
        except Exception:
            report.failures.append(
                f"{case.name}: the one-process oracle raised:\n{traceback.format_exc()}"
            )
            continue
        for layout in _axis_layouts(case.layouts, mesh.ndim):
            where = f"{case.name} {[tuple(p) for p in layout]} on mesh {mesh.shape}"
            before = fallback_counts()
            report.checked += 1
            try:
                # a case that may fall back (rule False or None) runs outside strict mode
                with strict_mode(case.rule is True):
                    leaves = _leaves(case, partial(_our_leaf, mesh, layout, seed))
                    got_out, got_grads, outs = _run(case, leaves, _our_full, seed)
                problems = _compare("output", got_out, want_out, case)
                problems += _compare("grad", got_grads, want_grads, case)
                problems += _check_local_shapes(outs)
            except Exception:
                problems = [f"raised:\n{traceback.format_exc()}"]
            after = fallback_counts()
            fell_back = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            for k, v in fell_back.items():
                report.fallbacks[k] = report.fallbacks.get(k, 0) + v
            if case.rule is True and fell_back:
                problems.append(f"fell back for {sorted(fell_back)}")
            if case.rule is False and not fell_back:
                problems.append("expected a fallback, ran through rules")
            report.failures += [f"{where}: {p}" for p in problems]
            if torch_mesh is not None and case.torch_check:
                torch_leaves = partial(_torch_leaf, torch_mesh, layout, seed)
                _torch_check(case, torch_leaves, seed, where, want_out, want_grads, report)
    return report


def _torch_check(
    case: OpCase,
    make: MakeLeaf,
    seed: int,
    where: str,
    want_out: list[Any],
    want_grads: list[torch.Tensor | None],
    report: Report,
) -> None:
    """The same case on torch.distributed.tensor, when torch supports it."""
    try:
        got_out, got_grads, _ = _run(case, _leaves(case, make), _torch_full, seed)
    except Exception as exc:
        report.torch_unsupported.append(f"{where}: {type(exc).__name__}")
        return
    report.torch_checked += 1
    problems = _compare("torch output", got_out, want_out, case)
    problems += _compare("torch grad", got_grads, want_grads, case)
    # torch disagreeing with the one-process oracle is torch's problem; record, don't fail
    if problems:
        report.torch_unsupported.append(f"{where}: torch differs: {problems[0]}")


MESH_SHAPES: dict[int, tuple[tuple[int, ...], ...]] = {1: ((1,),), 2: ((2,),), 4: ((4,), (2, 2))}
"""The meshes each world size runs: 1-D, and on 4 ranks also a 2x2 mesh (nested shards)."""


def _rank_main(
    cases_fn: Callable[[], list[OpCase]], world_size: int, with_torch: bool
) -> list[Report]:
    reports: list[Report] = []
    for shape in MESH_SHAPES[world_size]:
        mesh, torch_mesh = make_meshes(shape, with_torch=with_torch)
        reports.append(check_cases(cases_fn(), mesh, torch_mesh))
    return reports


def run_cases(
    cases_fn: Callable[[], list[OpCase]], world_size: int, *, timeout_s: float = 240.0
) -> Report:
    """Check every case of ``cases_fn()`` on ``world_size`` ranks; fail listing each broken case.

    ``cases_fn`` must be a module-level function (each rank builds the cases itself).
    The torch.distributed.tensor comparison runs on 2 ranks only (it costs seconds
    of import per rank process).
    """
    from tests._harness import run_on_ranks

    results = run_on_ranks(
        _rank_main, world_size, cases_fn, world_size, world_size == 2, timeout_s=timeout_s
    )
    failures: list[str] = []
    for rank, reports in enumerate(results):
        for report in reports:
            failures += [f"rank {rank}: {f}" for f in report.failures]
    if failures:
        shown = "\n".join(failures[:40])
        raise AssertionError(f"{len(failures)} failing checks (first 40):\n{shown}")
    expected = sum(
        len(_axis_layouts(case.layouts, len(shape)))
        for shape in MESH_SHAPES[world_size]
        for case in cases_fn()
    )
    merged = Report()
    for report in results[0]:
        merged.checked += report.checked
        merged.torch_checked += report.torch_checked
        merged.torch_unsupported += report.torch_unsupported
        for k, v in report.fallbacks.items():
            merged.fallbacks[k] = merged.fallbacks.get(k, 0) + v
    assert merged.checked == expected, f"{merged.checked} checks ran, {expected} expected"
    if world_size == 2:
        assert merged.torch_checked > 0, "no case ran on torch.distributed.tensor"
    return merged

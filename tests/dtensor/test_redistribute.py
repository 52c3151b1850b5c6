"""Redistribution: every placement pair against the single-process oracle and torch DTensor.

The oracle is independent of hp-dtensor's chunk arithmetic: shards are ``torch.chunk``
pieces (nested in mesh-axis order), and a Partial tensor is the reduction of one full
random tensor per coordinate of the Partial mesh axes. Values are small integers, so
sums and averages over 2 or 4 ranks are exact and results compare with ``torch.equal``.
Each world size is one launch; every case's failure is collected as a message.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from tests._harness import run_on_ranks, world_sizes
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    collectives,
    init_device_mesh,
)

REDUCE_OPS = ("sum", "avg", "max", "min")
SOURCES: tuple[Placement, ...] = (
    Shard(0),
    Shard(1),
    Replicate(),
    *(Partial(op) for op in REDUCE_OPS),  # type: ignore[arg-type]
)
TARGETS: tuple[Placement, ...] = (Shard(0), Shard(1), Replicate())
# even, uneven (5 rows on 4 ranks: 2, 2, 1, 0), and mostly-empty shards (1 row on 4 ranks)
SHAPES: tuple[tuple[int, ...], ...] = ((4, 8), (5, 3), (1, 7))


# -- the oracle --------------------------------------------------------------------------
def chunk_piece(t: torch.Tensor, dim: int, num_chunks: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``torch.chunk(t, num_chunks, dim)``; empty where torch.chunk has none."""
    pieces = torch.chunk(t, num_chunks, dim) if t.shape[dim] > 0 else ()
    if index < len(pieces):
        return pieces[index]
    return t.narrow(dim, t.shape[dim], 0)


def oracle_shard(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """The shard of ``full`` at ``coordinate``: torch.chunk pieces, outer mesh axis first."""
    local = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            local = chunk_piece(local, p.dim, mesh_shape[axis], coordinate[axis])
    return local.contiguous()


def grad_layout(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The layout of a gradient of a value laid out as ``placements`` (Partial -> Replicate)."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def reduce_stack(stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Reduce ``stacked`` over its first dim with ``reduce_op``."""
    if reduce_op == "sum":
        return stacked.sum(0)
    if reduce_op == "avg":
        return stacked.mean(0)
    if reduce_op == "max":
        return stacked.amax(0)
    return stacked.amin(0)


def partial_layout(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    generator: torch.Generator,
) -> tuple[dict[tuple[int, ...], torch.Tensor], torch.Tensor]:
    """One full random tensor per coordinate of the Partial axes, and their reduction.

    Without Partial axes there is a single tensor (key ``()``), which is the result.
    """
    partial_axes = [axis for axis, p in enumerate(placements) if p.is_partial()]
    keys = list(itertools.product(*(range(mesh_shape[axis]) for axis in partial_axes)))
    pieces = {key: torch.randint(-8, 9, tuple(shape), generator=generator).float() for key in keys}
    if not partial_axes:
        return pieces, pieces[()]
    reduce_op = placements[partial_axes[0]].reduce_op  # type: ignore[attr-defined]
    full = reduce_stack(torch.stack([pieces[key] for key in keys]), reduce_op)
    return pieces, full


def local_input(
    pieces: dict[tuple[int, ...], torch.Tensor],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """This rank's local tensor of a (possibly Partial) layout built by :func:`partial_layout`."""
    key = tuple(coordinate[axis] for axis, p in enumerate(placements) if p.is_partial())
    return oracle_shard(pieces[key], mesh_shape, coordinate, placements)


def expected_collectives(
    src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int] | None = None
) -> int:
    """Collectives a redistribution needs: one per mesh axis whose layout needs communication.

    An axis of more than one rank needs one when it leaves Shard or Partial for another
    placement, or when it keeps a Shard of a dim whose outer split (by an earlier axis)
    changes. On an axis of one rank every placement holds the same values.
    """
    if mesh_shape is not None:
        src = [d if n == 1 else s for s, d, n in zip(src, dst, mesh_shape, strict=True)]
    count = 0
    for axis, (s, d) in enumerate(zip(src, dst, strict=True)):
        if s == d:
            outer_changes = any(src[k] != dst[k] and s in (src[k], dst[k]) for k in range(axis))
            count += int(isinstance(s, Shard) and outer_changes)
        elif not isinstance(s, Replicate):
            count += 1
    return count


def to_torch_placements(placements: Sequence[Placement]) -> list[tdt.Placement]:
    """The same placements as torch.distributed.tensor objects."""
    result: list[tdt.Placement] = []
    for p in placements:
        if isinstance(p, Shard):
            result.append(tdt.Shard(p.dim))
        elif isinstance(p, Partial):
            result.append(tdt.Partial(p.reduce_op))
        else:
            result.append(tdt.Replicate())
    return result


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, as torch computes them."""
    return tuple(torch.empty(tuple(shape), device="meta").stride())


# -- one case on every rank ----------------------------------------------------------------
def check_case(
    mesh: DeviceMesh,
    torch_mesh: TorchMesh | None,
    shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    seed: int,
    *,
    backward: bool = True,
) -> list[str]:
    """Redistribute ``src`` -> ``dst`` forward (and backward); return failure messages."""
    where = f"mesh {mesh.shape} shape {shape} {src} -> {dst}"
    failures: list[str] = []
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    generator = torch.Generator().manual_seed(seed)
    pieces, full = partial_layout(shape, mesh.shape, src, generator)
    weight = torch.randint(-4, 5, shape, generator=generator).float()
    local = local_input(pieces, mesh.shape, coordinate, src)
    leaf = local.clone().requires_grad_(backward)

    kinds: list[str] = []
    with collectives.observe_collectives(lambda record: kinds.append(record.kind)):
        x = DTensor.from_local(leaf, mesh, src, shape=shape, stride=torch.empty(shape).stride())
        y = x.redistribute(mesh, dst)
    expected = oracle_shard(full, mesh.shape, coordinate, dst)
    if not torch.equal(y.to_local(), expected):
        failures.append(f"{where}: local {y.to_local().tolist()} != oracle {expected.tolist()}")
    if tuple(y.shape) != shape or y.placements != dst:
        failures.append(f"{where}: result has shape {tuple(y.shape)} placements {y.placements}")
    if len(kinds) != expected_collectives(src, dst, mesh.shape):
        failures.append(
            f"{where}: {len(kinds)} collectives {kinds}, "
            f"expected {expected_collectives(src, dst, mesh.shape)}"
        )

    if backward:
        torch.autograd.backward((y.full_tensor() * weight).sum())
        expected_grad = oracle_shard(weight, mesh.shape, coordinate, grad_layout(src))
        if leaf.grad is None or not torch.equal(leaf.grad, expected_grad):
            found = None if leaf.grad is None else leaf.grad.tolist()
            failures.append(
                f"{where}: backward local grad {found} != oracle {expected_grad.tolist()}"
            )

    if torch_mesh is not None:
        failures.extend(
            _compare_with_torch(torch_mesh, local, shape, src, dst, y, len(kinds), where)
        )
    return failures


def _compare_with_torch(
    torch_mesh: TorchMesh,
    local: torch.Tensor,
    shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    ours: DTensor,
    our_collectives: int,
    where: str,
) -> list[str]:
    """Same inputs through torch.distributed.tensor: same local shard, no fewer collectives."""
    try:
        tx = tdt.DTensor.from_local(
            local,
            torch_mesh,
            to_torch_placements(src),
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
        with CommDebugMode() as comm_mode:  # type: ignore[no-untyped-call]
            ty = tx.redistribute(torch_mesh, to_torch_placements(dst))
            torch_local = ty.to_local().contiguous()
        torch_collectives = comm_mode.get_total_counts()
    except (RuntimeError, NotImplementedError, ValueError, AssertionError):
        return []  # a case torch does not support (e.g. a reduce op gloo lacks)
    failures = []
    if not torch.equal(ours.to_local(), torch_local):
        failures.append(
            f"{where}: local {ours.to_local().tolist()} != torch DTensor's {torch_local.tolist()}"
        )
    if our_collectives > torch_collectives:
        failures.append(
            f"{where}: {our_collectives} collectives, torch DTensor needs {torch_collectives}"
        )
    return failures


def _same_on_all_ranks(failures: list[str]) -> list[str]:
    """Every rank's failures (so a rank-specific mismatch is reported by all)."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    return [f"rank {rank}: {msg}" for rank, msgs in enumerate(gathered) for msg in msgs or []]


# -- the matrix ----------------------------------------------------------------------------
def _matrix_1d(mesh: DeviceMesh, torch_mesh: TorchMesh) -> tuple[list[str], int]:
    failures: list[str] = []
    cases = 0
    for shape in SHAPES:
        for src in SOURCES:
            for dst in TARGETS:
                failures += check_case(mesh, torch_mesh, shape, (src,), (dst,), seed=cases)
                cases += 1
    return failures, cases


def _matrix_2d(mesh: DeviceMesh, torch_mesh: TorchMesh) -> tuple[list[str], int]:
    """Every pair of per-axis placements; a Partial's reduce op cycles so all four appear."""
    failures: list[str] = []
    cases = 0
    per_axis: tuple[Placement, ...] = (Shard(0), Shard(1), Replicate(), Partial())
    for shape in ((5, 3), (1, 7), (4, 4)):
        for src_pair in itertools.product(per_axis, repeat=2):
            for dst in itertools.product(TARGETS, repeat=2):
                op = REDUCE_OPS[cases % len(REDUCE_OPS)]
                src = tuple(Partial(op) if p.is_partial() else p for p in src_pair)  # type: ignore[arg-type]
                failures += check_case(mesh, torch_mesh, shape, src, dst, seed=cases)
                cases += 1
    return failures, cases


def _redistribute_matrix(world_size: int) -> tuple[list[str], int]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    torch_mesh = torch_init_device_mesh("cpu", (world_size,))
    failures, cases = _matrix_1d(mesh, torch_mesh)
    if world_size == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2))
        torch_mesh_2d = torch_init_device_mesh("cpu", (2, 2))
        more, count = _matrix_2d(mesh_2d, torch_mesh_2d)
        failures += more
        cases += count
    return _same_on_all_ranks(failures), cases


@world_sizes(1, 2, 4)
def test_redistribute_matrix_matches_oracle_and_torch(world_size: int) -> None:
    """{S0, S1, R, P(sum/avg/max/min)} -> {S0, S1, R}: values, gradients, collective counts."""
    results = run_on_ranks(_redistribute_matrix, world_size, world_size, timeout_s=240)
    failures, cases = results[0]
    assert cases >= 63
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:15])


# -- nested sharding and named cases ---------------------------------------------------------
def _nested_and_multi_axis() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2))
    torch_mesh = torch_init_device_mesh("cpu", (2, 2))
    s0, s1, r = Shard(0), Shard(1), Replicate()
    cases: list[tuple[tuple[Placement, ...], tuple[Placement, ...]]] = [
        ((s0, s0), (r, r)),  # nested split of one dim, both axes gather
        ((r, r), (s0, s0)),  # nested split by local slices only
        ((s0, s0), (s0, r)),
        ((s0, s0), (r, s0)),  # the outer axis leaves: the inner shard is regathered
        ((s0, s0), (s1, s1)),
        ((s0, s1), (s1, s0)),  # both axes move at once
        ((Partial(), Partial()), (s0, s0)),
        ((Partial("max"), s1), (s1, s1)),
        ((s1, Partial("avg")), (s1, s1)),
    ]
    failures: list[str] = []
    for seed, (src, dst) in enumerate(cases):
        for shape in ((9, 5), (3, 2), (0, 4)):
            failures += check_case(mesh, torch_mesh, shape, src, dst, seed)
    return _same_on_all_ranks(failures)


def test_redistribute_nested_and_multi_axis_on_2x2_mesh() -> None:
    results = run_on_ranks(_nested_and_multi_axis, 4, timeout_s=180)
    assert not results[0], "\n".join(results[0][:15])


def _appender(events: list[tuple[str, int, int]]) -> collectives.Observer:
    """An observer that appends each ``(kind, bytes_per_rank, group_size)`` to ``events``."""
    return lambda record: events.append((record.kind, record.nbytes, record.group_size))


# -- the cost model -----------------------------------------------------------------------------
def _collective_kinds() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2))
    failures: list[str] = []
    s0, s1, r = Shard(0), Shard(1), Replicate()
    expectations: list[tuple[tuple[Placement, ...], tuple[Placement, ...], list[str]]] = [
        ((s0, r), (r, r), ["all_gather"]),
        ((Partial(), r), (r, r), ["all_reduce"]),
        ((Partial(), r), (s0, r), ["reduce_scatter"]),
        ((s0, r), (s1, r), ["all_to_all"]),
        ((r, r), (s0, s1), []),  # local slices
        ((s0, s1), (r, r), ["all_gather", "all_gather"]),
        ((Partial(), Partial()), (r, r), ["all_reduce", "all_reduce"]),
        ((s0, Partial()), (r, s1), ["all_gather", "reduce_scatter"]),
    ]
    for src, dst, kinds in expectations:
        recorded: list[tuple[str, int, int]] = []
        with collectives.observe_collectives(_appender(recorded)):
            DTensor.from_local(torch.ones(4, 6), mesh, src).redistribute(mesh, dst)
        found = sorted(kind for kind, _, _ in recorded)
        if found != sorted(kinds):
            failures.append(f"{src} -> {dst}: collectives {found}, expected {sorted(kinds)}")
        if any(group_size != 2 for _, _, group_size in recorded):
            failures.append(f"{src} -> {dst}: group sizes {recorded}, expected 2 (one mesh axis)")
    return failures


def test_redistribute_uses_the_cheapest_collective_per_axis() -> None:
    """S->R all-gather, P->R all-reduce, P->S reduce-scatter, S(i)->S(j) all-to-all, R->S none."""
    results = run_on_ranks(_collective_kinds, 4, timeout_s=120)
    assert all(not failures for failures in results), results


@pytest.mark.parametrize(
    ("src", "dst", "count"),
    [
        ((Shard(0), Shard(0)), (Replicate(), Shard(0)), 2),
        ((Replicate(), Shard(0)), (Shard(0), Shard(0)), 1),
        ((Shard(0),), (Shard(0),), 0),
        ((Replicate(),), (Shard(1),), 0),
        ((Partial(),), (Shard(1),), 1),
    ],
)
def test_expected_collectives_spec(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], count: int
) -> None:
    """The counting spec the matrix asserts against, on a few hand-checked cases."""
    assert expected_collectives(src, dst) == count


def test_oracle_chunk_piece_follows_torch_chunk_with_empty_tail() -> None:
    t = torch.arange(5)
    assert [chunk_piece(t, 0, 4, i).tolist() for i in range(4)] == [[0, 1], [2, 3], [4], []]
    assert chunk_piece(torch.empty(0, 3), 0, 2, 1).shape == (0, 3)


def test_expected_collectives_spec_skips_axes_of_one_rank() -> None:
    src, dst = (Shard(0), Partial()), (Replicate(), Replicate())
    assert expected_collectives(src, dst, (1, 2)) == 1
    assert expected_collectives(src, dst, (2, 2)) == 2

"""Hypothesis-generated shapes and placements, redistributed on real process groups.

Hypothesis runs *inside* one launch per world size: every rank runs the same
derandomized search, so all ranks draw the same examples in the same order and
meet in the same collectives. A failure is agreed on by all ranks (an all-gather
of every rank's messages), so all of them raise on the same example.
"""

from __future__ import annotations

import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor.test_redistribute import REDUCE_OPS, check_case
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hyper_parallel.dtensor import (
    DeviceMesh,
    Partial,
    Placement,
    Replicate,
    Shard,
    init_device_mesh,
)

EXAMPLES = 25


def _placements(
    ndim: int, mesh_ndim: int, reduce_op: str, allow_partial: bool
) -> st.SearchStrategy[tuple[Placement, ...]]:
    choices: list[Placement] = [Replicate(), *(Shard(d) for d in range(ndim))]
    if allow_partial:
        choices.append(Partial(reduce_op))  # type: ignore[arg-type]
    return st.tuples(*([st.sampled_from(choices)] * mesh_ndim))


@st.composite
def _cases(
    draw: st.DrawFn, mesh_ndim: int
) -> tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...]]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    reduce_op = draw(st.sampled_from(REDUCE_OPS))
    src = draw(_placements(len(shape), mesh_ndim, reduce_op, allow_partial=True))
    dst = draw(_placements(len(shape), mesh_ndim, reduce_op, allow_partial=False))
    return shape, src, dst


def _agreed(failures: list[str]) -> list[str]:
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    return [f"rank {rank}: {m}" for rank, msgs in enumerate(gathered) for m in msgs or []]


def _run_property(mesh: DeviceMesh, torch_mesh: object) -> int:
    count = [0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        print_blob=False,
    )
    @given(case=_cases(mesh.ndim))
    def redistribute_matches_oracle(
        case: tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...]],
    ) -> None:
        shape, src, dst = case
        count[0] += 1
        failures = _agreed(check_case(mesh, torch_mesh, shape, src, dst, seed=count[0]))  # type: ignore[arg-type]
        assert not failures, "\n".join(failures[:10])

    redistribute_matches_oracle()
    return count[0]


def _property(world_size: int) -> int:
    mesh = init_device_mesh("cpu", (world_size,))
    examples = _run_property(mesh, torch_init_device_mesh("cpu", (world_size,)))
    if world_size == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2))
        examples += _run_property(mesh_2d, torch_init_device_mesh("cpu", (2, 2)))
    return examples


@world_sizes(2, 4)
def test_redistribute_hypothesis_shapes_and_placements(world_size: int) -> None:
    """Random shapes (dims of size 0..6, 1..3 dims) and placements: oracle, torch, counts."""
    results = run_on_ranks(_property, world_size, world_size, timeout_s=240)
    assert len(set(results)) == 1 and results[0] >= EXAMPLES

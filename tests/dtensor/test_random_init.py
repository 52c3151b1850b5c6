"""Random fills of DTensors equal, slice by slice, the same fill of the full tensor on one device.

Oracle: after the same ``torch.manual_seed``, the call on a plain full tensor in the
same process. Each rank compares the gathered DTensor with it bitwise, and the
next draw of the generator too (the generator must end where one device's does).
Pieces of 32 elements force the chunked path on these tiny tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
)
from hyper_parallel.dtensor._ops.random import generation_chunk

init = torch.nn.init
Fill = Callable[[torch.Tensor], torch.Tensor]

FILLS: dict[str, Fill] = {
    "normal_": partial(init.normal_, mean=0.5, std=2.0),
    "uniform_": partial(init.uniform_, a=-3.0, b=1.0),
    "kaiming_uniform_": partial(init.kaiming_uniform_, a=5**0.5),
    "kaiming_normal_": partial(init.kaiming_normal_, mode="fan_out"),
    "trunc_normal_": partial(init.trunc_normal_, std=0.5, a=-0.6, b=0.6),  # rejection loop
    "trunc_normal_narrow": partial(init.trunc_normal_, a=1.0, b=1.2),  # uniform-proposal branch
    "xavier_uniform_": init.xavier_uniform_,
    "xavier_normal_": partial(init.xavier_normal_, gain=1.5),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(2.0),
    "random_": lambda t: t.random_(-5, 17),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "dropout": lambda t: F.dropout(t.fill_(1.5), p=0.4, training=True),
}
SHAPES = ((10, 7), (3, 5, 6))  # uneven on 2 and 4 ranks; dim 0 of the second leaves empty shards


def _placements_for(mesh: DeviceMesh, ndim: int) -> list[tuple[Placement, ...]]:
    if mesh.ndim == 1:
        return [(Shard(0),), (Shard(ndim - 1),), (Replicate(),)]
    return [
        (Shard(0), Shard(1)),
        (Shard(1), Shard(0)),
        (Shard(0), Shard(0)),  # nested: the second axis splits each first-axis chunk
        (Replicate(), Shard(ndim - 1)),
        (Shard(1), Replicate()),
    ]


def _check_fill(
    name: str,
    fill: Fill,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    seed: int,
) -> str | None:
    torch.manual_seed(seed)
    expected = fill(torch.zeros(shape, dtype=dtype))
    expected_next = torch.rand(4)
    dt = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, placements, src_data_rank=None)
    torch.manual_seed(seed)
    with generation_chunk(32):
        got = fill(dt)
    got_next = torch.rand(4)
    where = f"{name} {tuple(shape)} {dtype} {placements} on mesh {mesh.shape}"
    if not isinstance(got, DTensor):
        return f"{where}: returned {type(got).__name__}, expected a DTensor"
    if got.placements != placements:
        return f"{where}: placements {got.placements}, expected {placements}"
    if not torch.equal(got.full_tensor(), expected):
        return f"{where}: values differ from the one-device fill"
    if not torch.equal(got_next, expected_next):
        return f"{where}: the generator ended in another state than on one device"
    return None


def _random_fills_match_one_device(
    mesh_shapes: list[tuple[int, ...]],
) -> tuple[list[str], dict[str, int]]:
    failures: list[str] = []
    for mesh_shape in mesh_shapes:
        mesh = init_device_mesh("cpu", mesh_shape)
        seed = 0
        for shape in SHAPES:
            for placements in _placements_for(mesh, len(shape)):
                for name, fill in FILLS.items():
                    seed += 1
                    failure = _check_fill(name, fill, shape, torch.float32, mesh, placements, seed)
                    if failure:
                        failures.append(failure)
        # other dtypes take other kernels (normal_ of bfloat16 draws its tail differently)
        for dtype in (torch.float64, torch.bfloat16):
            for name in ("normal_", "uniform_", "bernoulli_"):
                placements = _placements_for(mesh, 2)[0]
                failure = _check_fill(name, FILLS[name], (9, 5), dtype, mesh, placements, 99)
                if failure:
                    failures.append(failure)
    return failures, fallback_counts()


def _explicit_generator_and_large_pieces() -> list[str]:
    """A generator passed by keyword is the one consumed; the default chunk size gives the same values."""
    failures: list[str] = []
    mesh = init_device_mesh("cpu", (2,))
    g_ref = torch.Generator().manual_seed(7)
    expected = init.normal_(torch.empty(40, 3), generator=g_ref)
    dt = distribute_tensor(torch.empty(40, 3), mesh, [Shard(0)], src_data_rank=None)
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(1)
    default_before = torch.get_rng_state()
    init.normal_(dt, generator=g)
    if not torch.equal(dt.full_tensor(), expected):
        failures.append("normal_(generator=g): values differ")
    if not torch.equal(g.get_state(), g_ref.get_state()):
        failures.append("normal_(generator=g): g ended in another state")
    if not torch.equal(torch.get_rng_state(), default_before):
        failures.append("normal_(generator=g): the default generator was consumed")
    for chunk in (16, 48, 1 << 18):
        torch.manual_seed(3)
        ref = torch.empty(37, 5).normal_()
        torch.manual_seed(3)
        dt = distribute_tensor(torch.empty(37, 5), mesh, [Shard(1)], src_data_rank=None)
        with generation_chunk(chunk):
            dt.normal_()
        if not torch.equal(dt.full_tensor(), ref):
            failures.append(f"normal_ with pieces of {chunk}: values differ")
    return failures


def test_random_fills_match_one_device_on_two_ranks() -> None:
    failures, fallbacks = run_on_ranks(_random_fills_match_one_device, 2, [(2,)], timeout_s=240)[0]
    assert failures == []
    assert not {op for op in fallbacks if "normal_" in op or "uniform_" in op or "bernoulli_" in op}


def test_random_fills_match_one_device_on_four_ranks_1d_and_2x2() -> None:
    results = run_on_ranks(_random_fills_match_one_device, 4, [(4,), (2, 2)], timeout_s=300)
    for failures, _ in results:
        assert failures == []


def test_explicit_generator_and_piece_size_do_not_change_values() -> None:
    assert run_on_ranks(_explicit_generator_and_large_pieces, 2)[0] == []


def test_generation_chunk_rejects_tiny_pieces() -> None:
    with pytest.raises(ValueError, match="expected an int >= 16"), generation_chunk(8):
        pass

"""Two jobs in one process build meshes of equal value: the live one is found, whichever dies.

A trainer run twice in one process (a test, a notebook, a sweep) builds its meshes
again with the same ranks and names; the first run's meshes may survive as garbage in
a reference cycle and be collected at any later moment. What finds a mesh by value
(unpickling, fully_shard's search for the mesh joining FSDP's and a parameter's) must
still find the second run's meshes after that. Oracle: the same layer on full tensors
in one process (forward and weight gradient).
"""

from __future__ import annotations

import gc
import pickle
from typing import Any

import torch
from tests._harness import run_on_ranks
from torch import nn

import hyper_parallel.dtensor as hp
from hyper_parallel.dtensor.fsdp import fully_shard
from hyper_parallel.dtensor.parallel import ColwiseParallel, parallelize_module

DIM = 4


def _meshes() -> tuple[hp.DeviceMesh, hp.DeviceMesh]:
    """A job's two families over one world of 2 ranks, as ParallelDims builds them."""
    world = hp.DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("dp", "tp"))
    fsdp = hp.DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("fsdp", "tp"))
    return world, fsdp


def _layer() -> nn.Linear:
    torch.manual_seed(5)
    return nn.Linear(DIM, 2 * DIM)


def _second_job_after_the_first_is_collected() -> dict[str, Any]:
    gc.disable()  # the first job's meshes stay garbage until the collection below
    try:
        first: list[Any] = [*_meshes()]
        first.append(first[0]["tp"])
        first.append(first)  # only this cycle holds them
        first_groups = [first[0].get_group("tp"), first[1].get_group("fsdp")]
        del first
        world, fsdp = _meshes()  # the second job: equal values, built while the first's live
        # equal meshes share their groups: whichever a lookup by value finds, every rank
        # runs a collective on the same group (a group per mesh object hung two jobs)
        second_groups = [world.get_group("tp"), fsdp.get_group("fsdp")]
        shared = all(new is old for new, old in zip(second_groups, first_groups, strict=True))
        model = _layer()
        parallelize_module(model, world["tp"], {"": ColwiseParallel(use_local_output=False)})
        gc.collect()  # the first job's meshes go now
        restored = pickle.loads(pickle.dumps(world["tp"]))
        fully_shard(model, mesh=fsdp["fsdp"])
    finally:
        gc.enable()
    x = torch.arange(3 * DIM, dtype=torch.float32).reshape(3, DIM) / 7
    y = model(x)
    y.sum().backward()
    weight: Any = model.weight
    return {
        "y": y.full_tensor().detach(),
        "grad": weight.grad.full_tensor(),
        "weight_mesh": weight.device_mesh.mesh_dim_names,
        "unpickled_is_live": restored is world["tp"],
        "groups_shared_with_the_first_job": shared,
        "unpickled_group_ranks": torch.distributed.get_process_group_ranks(restored.get_group()),
    }


def test_fsdp_with_tp_finds_a_second_job_meshes_after_the_first_job_is_collected() -> None:
    results = run_on_ranks(_second_job_after_the_first_is_collected, 2, timeout_s=120)
    layer = _layer()
    x = torch.arange(3 * DIM, dtype=torch.float32).reshape(3, DIM) / 7
    want = layer(x)
    want.sum().backward()
    assert layer.weight.grad is not None
    for rank, got in enumerate(results):
        assert got["weight_mesh"] == ("fsdp", "tp"), rank
        torch.testing.assert_close(got["y"], want.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(got["grad"], layer.weight.grad, rtol=1e-6, atol=0)
        # a pickled mesh reattaches to the live mesh of its value, with its process groups
        assert got["unpickled_is_live"], rank
        assert got["unpickled_group_ranks"] == [0, 1], rank
        assert got["groups_shared_with_the_first_job"], rank

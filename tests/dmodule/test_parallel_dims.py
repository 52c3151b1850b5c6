"""ParallelDims: degrees validated before anything is built, the world mesh and its views laid
out as TorchTitan lays them (checked against torch's own DeviceMesh), and parallelize(dims)
placing each state on the view its layout names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import Module, ParallelDims, ShardingConfig, ShardingError
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.llama_sharding import parallelize_llama
from hyper_parallel.dtensor import DTensor, Shard

# -- validation (one process: nothing is built) -----------------------------------------------


def test_dp_shard_minus_one_takes_the_rest_of_the_world() -> None:
    dims = ParallelDims(tp=2, cp=2, world_size=8)
    assert (dims.dp_shard, dims.dp, dims.efsdp) == (2, 2, 8)
    assert ParallelDims(dp_shard=2, tp=2, ep=2, etp=2, world_size=4).efsdp == 1


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (
            {"dp_shard": 2, "tp": 3, "world_size": 4},
            ["dp_shard", "2*", "3", "6", "world size is 4"],
        ),
        ({"tp": 3, "world_size": 4}, ["dp_shard=-1", "world size 4", "3"]),
        ({"tp": 2, "etp": 3, "world_size": 4}, ["etp must be 1 or tp (2)", "etp=3"]),
        ({"dp_shard": 2, "tp": 2, "ep": 4, "etp": 2, "world_size": 4}, ["ep=4", "dp_shard*cp = 2"]),
        ({"dp_shard": 2, "ep": 3, "world_size": 2}, ["ep=3", "dp_shard*cp*tp = 2"]),
        ({"tp": 0, "world_size": 4}, ["tp must be a positive int, found 0"]),
        ({"tp": 2.0, "world_size": 4}, ["tp must be an int, found 2.0"]),
    ],
)
def test_bad_degrees_are_refused_naming_them(kwargs: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        ParallelDims(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_ep_may_borrow_tp_ranks_when_etp_is_one() -> None:
    # ep divides dp_shard * cp * tp when etp == 1 (TorchTitan's rule), not when etp == tp
    assert ParallelDims(tp=4, ep=4, world_size=4).efsdp == 1
    with pytest.raises(ValueError, match="ep=4 must divide dp_shard\\*cp = 1"):
        ParallelDims(tp=4, ep=4, etp=4, world_size=4)


# -- meshes (4 ranks) ------------------------------------------------------------------------


def _layouts(kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dims = ParallelDims(**kwargs)
    world = dims.build_mesh("cpu")
    again = dims.build_mesh()
    views = {
        name: (mesh.mesh_dim_names, mesh.mesh.tolist())
        for name, mesh in {
            "world": world,
            "dense": dims.dense_mesh,
            "expert": dims.expert_mesh,
            "batch": dims.batch_mesh,
            "loss": dims.loss_mesh,
            "fsdp": dims.fsdp_mesh,
            "efsdp": dims.efsdp_mesh,
            "ep": dims.get_mesh("ep"),
        }.items()
    }
    # the oracle: torch's own DeviceMesh over the same shape and names, sliced the same way
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    names = world.mesh_dim_names or ()
    theirs = torch_mesh("cpu", world.shape, mesh_dim_names=names)
    torch_views = {name: theirs[name].mesh.tolist() for name in names}
    ours = {name: world[name].mesh.tolist() for name in names}
    return {
        "same": again is world,
        "views": views,
        "ours": ours,
        "torch": torch_views,
        "world_dense_equal": dims.get_mesh(("dp_shard", "tp")) is dims.get_mesh(("dp_shard", "tp")),
    }


def test_world_mesh_and_views_follow_titans_rank_layout() -> None:
    # dp_shard=2 x tp=2, ep=2 borrowing tp (etp=1): efsdp = 2
    results = run_on_ranks(_layouts, 4, {"dp_shard": 2, "tp": 2, "ep": 2}, timeout_s=240)
    for rank, got in enumerate(results):
        assert got["same"] and got["world_dense_equal"]
        assert got["ours"] == got["torch"], f"rank {rank}: slices differ from torch's DeviceMesh"
        views = got["views"]
        assert views["world"] == (("dp_shard", "tp"), [[0, 1], [2, 3]])
        assert views["dense"][0] == ("dp_replicate", "dp_shard", "cp", "tp")
        assert views["expert"] == (
            ("dp_replicate", "efsdp", "ep", "etp"),
            [[[[0], [1]], [[2], [3]]]],
        )
        # ep is the fastest part of (dp_shard, cp, tp): the tp pair; efsdp holds the rest
        assert views["ep"] == (("ep",), [[0, 1], [2, 3]][rank // 2])
        assert views["efsdp"] == (("efsdp",), [[0, 2], [1, 3]][rank % 2])
        assert views["batch"] == (("batch",), [[0, 2], [1, 3]][rank % 2])
        assert views["loss"] == (("loss",), [[0, 2], [1, 3]][rank % 2])
        assert views["fsdp"] == (("fsdp",), [[0, 2], [1, 3]][rank % 2])


def test_views_with_pp_cp_and_expert_tp() -> None:
    results = run_on_ranks(_layouts, 4, {"pp": 2, "cp": 2, "ep": 2, "etp": 1}, timeout_s=240)
    for rank, got in enumerate(results):
        assert got["ours"] == got["torch"]
        views = got["views"]
        assert views["world"] == (("pp", "cp"), [[0, 1], [2, 3]])
        stage = [[0, 1], [2, 3]][rank // 2]
        assert views["loss"] == (("loss",), stage)  # batch x cp: the stage's cp pair
        assert views["batch"] == (("batch",), [rank])
        assert views["ep"] == (("ep",), stage)


# -- parallelize(dims): a mesh per state -------------------------------------------------------


class _DenseAndExperts(Module):
    """A dense weight sharded over tp and a stacked expert weight sharded over ep."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_experts: int = 4
        dim: int = 6
        param_init = {"dense": torch.nn.init.normal_, "experts": torch.nn.init.normal_}  # noqa: RUF012 - a Config field
        sharding_config = ShardingConfig(
            state_shardings={"dense": {"tp": Shard(0)}, "experts": {"ep": Shard(0)}}
        )

    def __init__(self, config: _DenseAndExperts.Config) -> None:
        super().__init__()
        self.config = config
        self.dense = torch.nn.Parameter(torch.empty(4, config.dim))
        self.experts = torch.nn.Parameter(torch.empty(config.num_experts, config.dim, 2))


def _mesh_per_state(kwargs: dict[str, Any], num_experts: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _DenseAndExperts.Config(num_experts=num_experts).build()
    model.init_states()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    dims = ParallelDims(**kwargs)
    try:
        model.parallelize(dims)  # builds the meshes itself
    except ShardingError as error:
        return {"error": str(error), "plain": not isinstance(model.experts, DTensor)}
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        out[name] = (p.device_mesh.mesh_dim_names, p.placements, p.to_local().shape)
        assert_close_to_scale(p.full_tensor(), full[name], rel=0.0, what=name)
    return out


def test_parallelize_dims_puts_dense_and_expert_weights_on_their_views() -> None:
    results = run_on_ranks(_mesh_per_state, 4, {"dp_shard": 2, "tp": 2, "ep": 2}, 4, timeout_s=240)
    for got in results:
        assert got["dense"] == (("tp",), (Shard(0),), torch.Size([2, 6]))
        assert got["experts"] == (("ep",), (Shard(0),), torch.Size([2, 6, 2]))


def test_parallelize_dims_refuses_an_axis_no_view_has_and_changes_nothing() -> None:
    results = run_on_ranks(_bad_axis, 2, timeout_s=240)
    for got in results:
        assert "'tpp'" in got["error"] and "the axes are" in got["error"], got["error"]
        assert got["plain"]


def _bad_axis() -> dict[str, Any]:
    torch.set_num_threads(1)
    config = _DenseAndExperts.Config()
    config.sharding_config = ShardingConfig(
        state_shardings={"dense": {"tpp": Shard(0)}, "experts": {"ep": Shard(0)}}
    )
    model = config.build()
    try:
        model.parallelize(ParallelDims(ep=2))
    except ShardingError as error:
        return {"error": str(error), "plain": not isinstance(model.experts, DTensor)}
    return {"error": "", "plain": False}


def _llama_fsdp_tp(kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = Llama.Config(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32)
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    dims = ParallelDims(**kwargs)
    parallelize_llama(model, dims)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    # each data-parallel rank reads its slice of the global batch
    rank, size = dims.batch_mesh.get_local_rank("batch"), dims.dp
    mine = tokens.chunk(size)[rank]
    loss = model.loss(mine[:, :-1], mine[:, 1:])
    loss.backward()
    want = reference.loss(tokens[:, :-1], tokens[:, 1:])
    want.backward()
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert p.grad is not None and q.grad is not None
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert_close_to_scale(got, q.grad, rel=1e-4, what=name)
    value = loss.detach()
    mean = torch.tensor([float(value.full_tensor() if isinstance(value, DTensor) else value)])
    torch.distributed.all_reduce(mean)
    return {"loss": float(mean) / torch.distributed.get_world_size(), "want": float(want)}


def test_parallelize_llama_from_parallel_dims_equals_one_process() -> None:
    results = run_on_ranks(_llama_fsdp_tp, 4, {"dp_shard": 2, "tp": 2}, timeout_s=240)
    for got in results:
        assert abs(got["loss"] - got["want"]) <= 1e-4 * abs(got["want"])

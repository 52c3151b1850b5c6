"""local_map blocks on 2 and 4 CPU ranks: forward on local shards vs one device, with gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks

from hyper_parallel.dmodule import LocalMapConfig, MeshAxisName, Module, ShardingConfig
from hyper_parallel.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

TP = MeshAxisName.TP
TIMEOUT_S = 240.0


class FeedForward(Module):
    """Column-parallel w1 then row-parallel w2 written on plain tensors (Megatron style)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 8
        hidden: int = 16
        param_init = {  # noqa: RUF012 - a Config field
            "w1": torch.nn.init.normal_,
            "b1": torch.nn.init.uniform_,
            "w2": torch.nn.init.normal_,
        }

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(config.hidden, config.dim))
        self.b1 = torch.nn.Parameter(torch.empty(config.hidden))
        self.w2 = torch.nn.Parameter(torch.empty(config.dim, config.hidden))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor, *, fail: bool = False) -> torch.Tensor:
        self.seen = [type(t).__name__ for t in (x, self.w1, self.b1, self.w2)]
        if fail:
            raise RuntimeError("failing on purpose")
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)  # a partial sum


def feed_forward_sharding() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"w1": {TP: Shard(0)}, "b1": {TP: Shard(0)}, "w2": {TP: Shard(1)}},
        in_src_shardings={"x": {}},
        in_dst_shardings={"x": {}},
        out_src_shardings={TP: Partial()},
        out_dst_shardings={TP: Replicate()},
        local_map=LocalMapConfig(in_grad_placements={"x": {TP: Partial()}}),
    )


class RowOnly(Module):
    """Row-parallel projection: input sharded on its last dim, output a partial sum."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        param_init = {"weight": torch.nn.init.normal_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def row_sharding() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}},
        in_dst_shardings={"x": {TP: Shard(-1)}},
        out_src_shardings={TP: Partial()},
        out_dst_shardings={TP: Replicate()},
        local_map=LocalMapConfig(),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))


def _local_map_blocks(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}

    torch.manual_seed(0)
    reference = FeedForward.Config().build()
    reference.init_states()
    block = FeedForward.Config(sharding_config=feed_forward_sharding()).build()
    block.load_state_dict(reference.state_dict())
    block.parallelize(mesh)

    torch.manual_seed(1)
    x_ref = torch.randn(3, 8, requires_grad=True)
    y_ref = reference(x_ref)
    (y_ref**2).sum().backward()
    x = x_ref.detach().clone().requires_grad_()
    y = block(x=x)  # keyword arguments are laid out too
    out["inside"] = block.seen
    out["output_placements"] = y.placements
    y.to_local().pow(2).sum().backward()
    out["forward"] = _rel(y.to_local(), y_ref)
    assert x.grad is not None and x_ref.grad is not None
    out["input_grad"] = _rel(x.grad, x_ref.grad)
    for name in ("w1", "b1", "w2"):
        p = block.get_parameter(name)
        ref_grad = reference.get_parameter(name).grad
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor) and ref_grad is not None
        out[f"{name}.grad"] = _rel(p.grad.full_tensor(), ref_grad)
        out[f"{name}.grad_placements"] = p.grad.placements
    out["states_restored"] = all(isinstance(block.get_parameter(n), DTensor) for n in ("w1", "w2"))
    try:
        block(x, fail=True)
        out["raised"] = False
    except RuntimeError:
        out["raised"] = True
    out["restored_after_error"] = all(
        isinstance(block.get_parameter(n), DTensor) for n in ("w1", "b1", "w2")
    )

    torch.manual_seed(2)
    row_ref = RowOnly.Config().build()
    row_ref.init_states()
    row = RowOnly.Config(sharding_config=row_sharding()).build()
    row.load_state_dict(row_ref.state_dict())
    row.parallelize(mesh)
    full = torch.randn(2, 8, requires_grad=True)
    (row_ref(full) ** 2).sum().backward()
    x_dt = DTensor.from_local(full.detach().clone(), mesh, [Replicate()]).redistribute(
        mesh, [Shard(-1)]
    )
    x_dt.requires_grad_()
    row_out: DTensor = row(x_dt)
    row_out.to_local().pow(2).sum().backward()  # type: ignore[no-untyped-call]
    x_grad = x_dt.grad
    assert full.grad is not None and isinstance(x_grad, DTensor)
    out["row_forward"] = _rel(row_out.to_local(), row_ref(full))
    out["row_input_grad"] = _rel(x_grad.full_tensor(), full.grad)
    out["row_input_grad_placements"] = x_grad.placements
    return out


@pytest.mark.parametrize("world_size", [2, 4], ids=["tp2", "tp4"])
def test_local_map_blocks_match_single_device_forward_and_gradients(world_size: int) -> None:
    for result in run_on_ranks(_local_map_blocks, world_size, world_size, timeout_s=TIMEOUT_S):
        assert result["inside"] == ["Tensor", "Tensor", "Tensor", "Tensor"]
        assert result["output_placements"] == (Replicate(),)
        assert result["raised"]
        assert result["states_restored"] and result["restored_after_error"]
        assert result["w1.grad_placements"] == (Shard(0),)
        assert result["w2.grad_placements"] == (Shard(1),)
        assert result["row_input_grad_placements"] == (Shard(1),)
        numbers = {k: v for k, v in result.items() if isinstance(v, float)}
        assert len(numbers) == 7
        assert max(numbers.values()) < 1e-5, numbers

"""End to end across the packages: a config (hp-config) builds a user's model (hp-dmodule)
that runs tensor parallel on DTensors (hp-dtensor) over real process groups (hp-platform-torch).

The model is written the way hp-dmodule's README teaches: the user's own ``Module``
subclasses declaring their layouts. Oracle: the same config, seed and data trained in
one process without parallelism. Checked: every step's loss, the trained parameters,
the collectives of a step (CommDebugMode against Megatron's count); the config is
changed from the command line (``apply_overrides``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import MeshAxisName, Module, ModuleList, ShardingConfig
from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Partial,
    Replicate,
    Shard,
    init_device_mesh,
)

TP = MeshAxisName.TP
STEPS = 3


def _init(t: torch.Tensor) -> object:
    return torch.nn.init.normal_(t, std=0.2)


class ColumnLinear(Module):
    """``x @ W.T`` with ``W`` split by rows: replicated input, output sharded by features."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int = 8
        out_features: int = 16
        param_init = {"weight": _init}  # noqa: RUF012
        sharding_config = ShardingConfig(
            state_shardings={"weight": {TP: Shard(0)}},
            in_dst_shardings={"x": {TP: Replicate()}},
            out_dst_shardings={TP: Shard(-1)},
        )

    def __init__(self, config: ColumnLinear.Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.out_features, config.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowLinear(Module):
    """``x @ W.T`` with ``W`` split by columns: feature-sharded input, partial sums reduced."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int = 16
        out_features: int = 8
        param_init = {"weight": _init}  # noqa: RUF012
        sharding_config = ShardingConfig(
            state_shardings={"weight": {TP: Shard(1)}},
            in_dst_shardings={"x": {TP: Shard(-1)}},
            out_dst_shardings={TP: Replicate()},
        )

    def __init__(self, config: RowLinear.Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.out_features, config.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Block(Module):
    """A residual MLP block: ``x + row(gelu(column(x)))``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 8
        hidden: int = 16

    def __init__(self, config: Block.Config) -> None:
        super().__init__()
        self.up = ColumnLinear.Config(in_features=config.dim, out_features=config.hidden).build()
        self.down = RowLinear.Config(in_features=config.hidden, out_features=config.dim).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(x)))
        return out


class Net(Module):
    """Blocks on a replicated input; the input arrives as a plain tensor on every rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        blocks: list[Block.Config] = field(default_factory=lambda: [Block.Config(), Block.Config()])
        sharding_config = ShardingConfig(in_dst_shardings={"x": {TP: Replicate()}})

    def __init__(self, config: Net.Config) -> None:
        super().__init__()
        self.blocks = ModuleList(c.build() for c in config.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _config() -> Net.Config:
    """The config as a user changes it from the command line."""
    return Net.Config().apply_overrides(["blocks.0.hidden=24", "blocks.1.hidden=32"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(4, 5, 8, generator=generator)
    return x, torch.randn(4, 5, 8, generator=generator)


def _train(model: torch.nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        out = model(x)
        full = out.full_tensor() if isinstance(out, DTensor) else out
        loss = F.mse_loss(full, y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _parallel_run(world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = _config().build()
    model.parallelize(mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()
    with CommDebugMode(model) as comm:
        model(_batch(0)[0]).full_tensor().sum().backward()  # type: ignore[no-untyped-call]
    model.zero_grad()
    layouts = {n: tuple(p.placements) for n, p in model.named_parameters()}
    losses = _train(model)
    return {
        "losses": losses,
        "state": _full_state(model),
        "comm": comm.by_module(),
        "layouts": layouts,
    }


def _single_process() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _config().build()
    model.init_states()
    losses = _train(model)
    return {"losses": losses, "state": _full_state(model)}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _single_process()


@world_sizes(2, 4)
def test_tensor_parallel_training_equals_one_process(
    world_size: int, reference: dict[str, Any]
) -> None:
    got = run_on_ranks(_parallel_run, world_size, world_size, timeout_s=240)[0]
    assert len(got["losses"]) == STEPS
    for step, (par, ref) in enumerate(zip(got["losses"], reference["losses"], strict=True)):
        assert abs(par - ref) <= 1e-5 * max(1.0, abs(ref)), f"step {step}: {par} != {ref}"
    assert set(got["state"]) == set(reference["state"])
    for name, ref in reference["state"].items():
        assert_close_to_scale(got["state"][name], ref, rel=1e-5, what=name)


def test_declared_layouts_give_megatrons_collectives() -> None:
    got = run_on_ranks(_parallel_run, 2, 2, timeout_s=240)[0]
    assert got["layouts"]["blocks.0.up.weight"] == (Shard(0),)
    assert got["layouts"]["blocks.1.down.weight"] == (Shard(1),)
    # forward: one all-reduce per block, at the row-parallel output (a Partial sum)
    for block in ("blocks.0.down", "blocks.1.down"):
        assert got["comm"][block] == {"all_reduce": 1}, got["comm"]
    # backward: Megatron's all-reduce of a block input's partial gradient, for block 1
    # only (block 0's input is the data, which needs no gradient); outputs need none.
    assert got["comm"]["backward"] == {"all_reduce": 1}, got["comm"]
    assert Partial() not in {p for layout in got["layouts"].values() for p in layout}


def test_config_with_a_sharding_config_round_trips_through_its_dict() -> None:
    config = _config()
    assert Net.Config.from_dict(config.to_dict()) == config

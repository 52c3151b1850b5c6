"""Initialisation at scale: meta build -> parallelize -> to_empty -> init_states equals one device.

The oracle is the same model built on one device and initialised after the same
``torch.manual_seed``; the parallel model must hold exactly (bitwise) its slices, on
TP 2, TP 4 and dp 2 x tp 2 meshes, whether it is initialised after parallelize (from a
meta build) or before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks

from hyper_parallel.dmodule import MeshAxisName, Module, ShardingConfig
from hyper_parallel.dtensor import (
    DTensor,
    Shard,
    fallback_counts,
    init_device_mesh,
    reset_fallback_counts,
)

TP = MeshAxisName.TP
DP = MeshAxisName.DP
TIMEOUT_S = 300.0


class Table(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        rows: int = 12
        cols: int = 8
        param_init = {"weight": torch.nn.init.normal_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.rows, config.cols))


class Projection(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        fan_in: int = 8
        fan_out: int = 10  # uneven over 4 ranks: chunks 3, 3, 3, 1
        param_init = {  # noqa: RUF012 - a Config field
            "weight": partial(torch.nn.init.kaiming_uniform_, a=math.sqrt(5)),
            "bias": partial(torch.nn.init.uniform_, a=-0.1, b=0.1),
        }

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.fan_out, config.fan_in))
        self.bias = torch.nn.Parameter(torch.empty(config.fan_out))


class Net(Module):
    """Mixed initializers, a plain nn child sharded by its parent, a sharded buffer."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        two_d: bool = False
        param_init = {"norm": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        table = {DP: Shard(1), TP: Shard(0)} if config.two_d else {TP: Shard(0)}
        self.table = Table.Config(
            sharding_config=ShardingConfig(state_shardings={"weight": table})
        ).build()
        self.column = Projection.Config(
            sharding_config=ShardingConfig(
                state_shardings={"weight": {TP: Shard(0)}, "bias": {TP: Shard(0)}}
            )
        ).build()
        self.row = Projection.Config(
            fan_in=10,
            fan_out=8,
            param_init={
                "weight": partial(torch.nn.init.trunc_normal_, std=0.02),
                "bias": torch.nn.init.zeros_,
            },
            sharding_config=ShardingConfig(state_shardings={"weight": {TP: Shard(1)}, "bias": {}}),
        ).build()
        self.plain = torch.nn.Linear(8, 6)  # reset_parameters: kaiming_uniform_ + uniform_
        self.norm = torch.nn.Parameter(torch.empty(8))
        self.register_buffer("freqs", torch.empty(6, 2))

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        self.freqs = torch.arange(12.0, device=buffer_device).reshape(6, 2) / 7


def net_sharding() -> ShardingConfig:
    return ShardingConfig(
        state_shardings={
            "plain.weight": {TP: Shard(0)},
            "plain.bias": {TP: Shard(0)},
            "norm": {},
            "freqs": {TP: Shard(0)},
        }
    )


def _states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _init_property(shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = Net.Config(two_d=len(shape) == 2, sharding_config=net_sharding())

    reference = config.build()  # building may draw (nn.Linear does): seed after it
    torch.manual_seed(seed)
    reference.init_states()
    expected = _states(reference)

    out: dict[str, Any] = {}
    with torch.device("meta"):
        meta_built = config.build()
    meta_built.parallelize(mesh)
    meta_built.to_empty(device="cpu")
    reset_fallback_counts()
    torch.manual_seed(seed)
    meta_built.init_states()
    out["fallbacks_during_init"] = fallback_counts()
    out["generator_matches"] = bool(torch.rand(1) == _after_reference_draw(seed, config))

    early = config.build()
    torch.manual_seed(seed)
    early.init_states()
    early.parallelize(mesh)

    for label, model in (("meta_then_init", meta_built), ("init_then_parallelize", early)):
        mismatched, not_local = [], []
        for name, state in _states(model).items():
            if not isinstance(state, DTensor):
                mismatched.append(f"{name} is not a DTensor")
                continue
            if not torch.equal(state.full_tensor(), expected[name]):
                mismatched.append(name)
            if state.to_local().device.type != "cpu" or state.to_local().numel() > state.numel():
                not_local.append(name)
            sharded = any(p.is_shard() for p in state.placements)
            if sharded and state.to_local().numel() == state.numel():
                not_local.append(name)
        out[f"{label}.mismatched"] = mismatched
        out[f"{label}.not_local"] = not_local
        out[f"{label}.count"] = len(_states(model))
    out["expected_count"] = len(expected)
    return out


def _after_reference_draw(seed: int, config: Net.Config) -> torch.Tensor:
    """The next random number after initialising on one device (the generator's position)."""
    state = torch.get_rng_state()
    model = config.build()
    torch.manual_seed(seed)
    model.init_states()
    value = torch.rand(1)
    torch.set_rng_state(state)
    return value


@pytest.mark.allows_fallback  # trunc_normal_'s `mask.any()` may fall back (see below)
@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_init_states_gives_the_single_device_values_bitwise(shape: tuple[int, ...]) -> None:
    world = math.prod(shape)
    for result in run_on_ranks(_init_property, world, shape, 1234, timeout_s=TIMEOUT_S):
        assert result["expected_count"] == 9
        for label in ("meta_then_init", "init_then_parallelize"):
            assert result[f"{label}.count"] == 9
            assert result[f"{label}.mismatched"] == [], label
            assert result[f"{label}.not_local"] == [], label
        assert result["generator_matches"]
        # No init op gathered a full tensor. (torch's trunc_normal_ asks `mask.any()` of a
        # 0-dim result: a scalar, reported to hp-dtensor as a fallback worth a rule.)
        fallbacks = dict(result["fallbacks_during_init"])
        fallbacks.pop("aten._local_scalar_dense.default", None)
        assert fallbacks == {}

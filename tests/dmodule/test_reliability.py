"""States that were never filled, stale optimizers, misread inputs, stalls on a sub-mesh (#19 items 2, 12)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from torch import nn

from hyper_parallel.dmodule import MeshAxisName, Module, ShardingConfig
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import DTensor, Replicate, Shard, init_device_mesh
from hyper_parallel.dtensor.parallel import RowwiseParallel, parallelize_module
from hyper_parallel.platform import get_platform

TOKENS = torch.arange(16).reshape(2, 8) % 200


class Dense(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        param_init = {"weight": nn.init.normal_, "bias": nn.init.normal_}  # noqa: RUF012 - a Config field
        sharding_config = ShardingConfig(
            state_shardings={
                "weight": {MeshAxisName.TP: Shard(0)},
                "bias": {MeshAxisName.TP: Replicate()},
            },
            in_src_shardings={"x": {MeshAxisName.TP: Replicate()}},
        )

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.bias = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


# ------------------------------------------------------------------- item 2: never initialised
def test_a_forward_after_to_empty_without_init_names_the_states_and_the_fix() -> None:
    with torch.device("meta"):
        model = Llama.Config(n_layers=1).build()
    model.to_empty(device="cpu")
    with pytest.raises(RuntimeError) as caught:
        model(TOKENS)
    message = str(caught.value)
    assert message.startswith("Llama.forward: 14 state(s) were never initialised since to_empty()")
    assert "'tok_embeddings.weight'" in message
    assert "call model.init_states() (init_weights() on a BaseModel) after to_empty()" in message


def test_loading_only_persistent_states_leaves_the_rope_buffers_named() -> None:
    torch.manual_seed(0)
    reference = Llama.Config(n_layers=1).build()
    reference.init_weights()
    with torch.device("meta"):
        model = Llama.Config(n_layers=1).build()
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())  # what load_hf / DCP fill: persistent only
    with pytest.raises(RuntimeError) as caught:
        model(TOKENS)
    message = str(caught.value)
    assert "2 state(s) were never initialised" in message
    assert "'layers.0.attention.rope_cos (non-persistent buffer)'" in message
    assert "'layers.0.attention.rope_sin (non-persistent buffer)'" in message
    model.init_weights()  # the documented order: to_empty, init, then load
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert torch.equal(model(TOKENS), reference(TOKENS))


def test_the_check_runs_once_and_leaves_no_hook_behind() -> None:
    with torch.device("meta"):
        model = Llama.Config(n_layers=1).build()
    assert _hooks(model) > 0  # armed by the meta build
    model.to_empty(device="cpu")
    model.init_weights()
    model(TOKENS)
    assert _hooks(model) == 0  # later steps pay nothing


def test_a_state_written_in_place_counts_as_initialised() -> None:
    with torch.device("meta"):
        layer = Dense.Config().build()
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.copy_(torch.eye(4))
    with pytest.raises(RuntimeError, match=r"1 state\(s\) were never initialised.*\['bias'\]"):
        layer(torch.ones(2, 4))
    with torch.no_grad():
        layer.bias.fill_(0.5)
    assert torch.equal(layer(torch.ones(2, 4)), torch.full((2, 4), 1.5))


# --------------------------------------------------- item 12: meta model never materialised
def test_a_meta_model_never_materialised_refuses_a_real_input() -> None:
    with torch.device("meta"):
        layer = Dense.Config().build()
    with pytest.raises(RuntimeError) as caught:
        layer(torch.ones(2, 4))
    assert str(caught.value) == (
        "Dense.forward: its states ['weight', 'bias'] are on the meta device (no memory), but "
        "an input is on cpu; call model.to_empty(device=...) and model.init_states() before "
        "running it"
    )
    # a forward on meta inputs (tracing shapes) stays allowed, as in torch
    assert layer(torch.ones(2, 4, device="meta")).shape == (2, 4)


# ------------------------------------------------ item 12: an optimizer built too early
def test_an_optimizer_over_meta_parameters_is_refused_after_to_empty() -> None:
    with torch.device("meta"):
        layer = Dense.Config().build()
    early = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.to_empty(device="cpu")
    layer.init_states()
    layer(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step: 2 of its parameters are no longer"):
        early.step()
    before = layer.weight.detach().clone()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert layer.weight.grad is not None
    assert torch.equal(layer.weight.detach(), before - 0.1 * layer.weight.grad)


def _optimizer_before_parallelize() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    layer = Dense.Config().build()
    layer.init_states()
    full = layer.weight.detach().clone()
    early = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.parallelize(mesh)
    x = torch.ones(2, 4)
    layer(x).full_tensor().sum().backward()
    out: dict[str, Any] = {}
    try:
        early.step()
        out["early"] = "no error"
    except RuntimeError as error:
        out["early"] = str(error)
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    # oracle, given identical gradients: d(sum(x @ W.T + b))/dW = column sums of x per row
    out["stepped"] = layer.weight.full_tensor()
    out["expected"] = full - 0.1 * torch.ones(4, 2) @ x
    return out


def test_an_optimizer_built_before_parallelize_is_refused_naming_the_parameters() -> None:
    result = run_on_ranks(_optimizer_before_parallelize, 2, timeout_s=120)[0]
    assert result["early"].startswith("SGD.step: 2 of its parameters are no longer the model's: ")
    assert "'Dense.weight (replaced by parallelize())'" in result["early"]
    assert "build the optimizer after parallelize() and to_empty()" in result["early"]
    assert_close_to_scale(result["stepped"], result["expected"], rel=1e-6)


# ------------------------------------------- item 12: RowwiseParallel given the full input
def _rowwise_full_input() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    linear = nn.Linear(8, 4)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    parallelize_module(linear, mesh, RowwiseParallel())
    x = torch.randn(2, 8)
    out: dict[str, Any] = {}
    try:
        linear(x)
        out["full"] = "no error"
    except RuntimeError as error:
        out["full"] = str(error)
    shard = x.chunk(2, dim=-1)[mesh.get_local_rank()]
    y = linear(shard)
    out["y"] = y.full_tensor() if isinstance(y, DTensor) else y
    out["expected"] = x @ weight.T + bias
    return out


def test_a_rowwise_linear_given_the_full_input_says_what_layout_it_expects() -> None:
    result = run_on_ranks(_rowwise_full_input, 2, timeout_s=120)[0]
    assert result["full"] == (
        "RowwiseParallel Linear(in_features=8, out_features=4, bias=True): got a plain input of "
        "shape (2, 8) (the full input), but the declared input layout is Shard(-1) on mesh "
        "axis 'tp' (2 ranks), so a plain tensor is taken as this rank's shard of the 8 input "
        "features: expected last dim 4; pass this rank's shard (x.chunk(2, dim=-1)[rank]), a "
        "DTensor, or declare RowwiseParallel(input_layouts=Replicate()) to pass the full input"
    )
    assert_close_to_scale(result["y"], result["expected"], rel=1e-6)


# -------------------------------------- item 12: a stall on a sub-mesh within the timeout
def _stall_on_sub_mesh(flag_dir: str) -> dict[str, Any]:
    # as `init_process_group(timeout=3 s)` under torchrun: the default group's timeout
    dist.set_timeout(timedelta(seconds=3))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    done = Path(flag_dir, "rank0-done")
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        started = time.monotonic()
        try:
            get_platform().all_reduce(torch.ones(1), mesh.get_group("tp"), "sum")
            out["error"] = "no error"
        except RuntimeError as error:
            out["error"] = str(error)
        out["waited_s"] = time.monotonic() - started
        done.write_text("1")
    else:  # never joins; stays alive so that rank 0 sees a stall, not a lost peer
        deadline = time.monotonic() + 100
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return out


def test_a_stall_on_a_sub_mesh_fails_within_the_default_groups_timeout(tmp_path: Path) -> None:
    result = run_on_ranks(_stall_on_sub_mesh, 2, str(tmp_path), timeout_s=150)[0]
    assert result["error"].startswith(
        "rank 0: all_reduce on mesh axis 'tp' of DeviceMesh('cpu', [[0, 1]], mesh_dim_names=("
        "'dp', 'tp')) (group ranks [0, 1]) timed out: one of peer ranks [1] did not arrive "
        "within the group's timeout ("
    ), result["error"]
    # torch's new_group default would wait 30 minutes (the run would be killed at 150 s)
    assert result["waited_s"] < 60

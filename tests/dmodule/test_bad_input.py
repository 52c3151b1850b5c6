"""Bad input hp-dmodule refuses with an error naming where, what was expected and what was found (#12 items 7, 8, 10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from torch import nn

from hyper_parallel.config import ConfigError, ConfigTypeError
from hyper_parallel.dmodule import MeshAxisName, Module, ShardingConfig
from hyper_parallel.dmodule.layers import Attention, Embedding, Linear, RMSNorm
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import Shard, init_device_mesh


class Dense(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        param_init = {"weight": nn.init.ones_, "bias": nn.init.zeros_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.bias = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


# ----------------------------------------------------------------------------- item 7
def test_param_init_naming_a_missing_parameter_fails_at_build_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        Dense.Config(param_init={"weight": nn.init.ones_, "bais": nn.init.zeros_}).build()
    assert str(info.value) == (
        "param_init.bais: Dense.Config.param_init names 'bais', which is not a parameter of "
        "Dense; its parameters are ['bias', 'weight']; did you mean 'bias'?"
    )


def test_param_init_set_on_the_module_is_checked_by_init_states_before_any_change() -> None:
    layer = Dense.Config().build()
    with torch.no_grad():
        layer.weight.fill_(7.0)
    layer._param_init = {"weight": nn.init.zeros_, "bias": nn.init.zeros_, "bais": nn.init.ones_}
    with pytest.raises(ValueError, match=r"Dense.Config.param_init names 'bais'"):
        layer.init_states()
    assert torch.all(layer.weight == 7.0)  # nothing was initialised


def test_a_non_callable_initializer_names_the_parameter() -> None:
    with pytest.raises(ConfigTypeError, match=r"^param_init\.weight: expected a callable"):
        Dense.Config(param_init={"weight": 0.02, "bias": nn.init.zeros_})  # type: ignore[dict-item]
    layer = Dense.Config().build()
    layer._param_init = {"weight": 0.02, "bias": nn.init.zeros_}  # type: ignore[dict-item]
    with pytest.raises(ValueError) as info:
        layer.init_states()
    assert (
        "Dense.weight: param_init['weight'] is float 0.02; expected a callable that fills the "
        "tensor in place" in str(info.value)
    )


def _new_tensor_init(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(tensor)  # returns a new tensor: the parameter stays as it was


def test_an_initializer_returning_a_new_tensor_is_an_error() -> None:
    layer = Dense.Config(param_init={"weight": _new_tensor_init, "bias": nn.init.zeros_}).build()
    with pytest.raises(ValueError) as info:
        layer.init_states()
    assert str(info.value).startswith(
        "Dense.weight: param_init['weight'] (_new_tensor_init) returned a new tensor instead of "
        "filling the parameter in place"
    )


def test_in_place_initializers_returning_their_argument_or_a_view_or_none_are_fine() -> None:
    def view_init(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1).fill_(2.0)

    def none_init(tensor: torch.Tensor) -> None:
        tensor.fill_(3.0)

    layer = Dense.Config(param_init={"weight": view_init, "bias": none_init}).build()
    layer.init_states()
    assert torch.all(layer.weight == 2.0) and torch.all(layer.bias == 3.0)


# ----------------------------------------------------------------------------- item 8
def _meta_without_to_empty() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, str] = {}
    with torch.device("meta"):
        model = Llama.Config(n_layers=1).build()
    model.parallelize(mesh)
    try:
        model.init_weights()
        out["init"] = "no error"
    except ValueError as error:
        out["init"] = str(error)
    tokens = torch.randint(0, 256, (2, 8))
    try:
        model(tokens)
        out["forward"] = "no error"
    except RuntimeError as error:
        out["forward"] = str(error)
    model.to_empty(device="cpu")
    model.init_weights()
    out["after_to_empty"] = str(tuple(model(tokens).shape))
    return out


def test_a_meta_model_must_be_materialised_before_init_or_forward() -> None:
    result = run_on_ranks(_meta_without_to_empty, 2, timeout_s=180)[0]
    assert result["init"].startswith("Llama.init_states: ")
    assert "are on the meta device ('tok_embeddings.weight'" in result["init"]
    assert "call model.to_empty(device=...) first" in result["init"]
    assert result["forward"].startswith("Llama.forward: its states ['tok_embeddings.weight', ")
    assert "are on the meta device (no memory), but an input is on cpu" in result["forward"]
    assert "call model.to_empty(device=...) and model.init_states()" in result["forward"]
    assert result["after_to_empty"] == "(2, 8, 256)"


def test_a_meta_model_that_is_not_parallelized_is_refused_by_init_states() -> None:
    with torch.device("meta"):
        layer = Dense.Config().build()
    with pytest.raises(ValueError, match=r"Dense.init_states: 2 parameter\(s\)/buffer\(s\)"):
        layer.init_states()


# ----------------------------------------------------------------------------- item 10
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_heads": 0}, "n_heads: expected an int >= 1, found 0"),
        ({"vocab_size": 0}, "vocab_size: expected an int >= 1, found 0"),
        ({"dim": -64}, "dim: expected an int >= 1, found -64"),
        ({"norm_eps": -1.0}, "norm_eps: expected a finite float > 0, found -1.0"),
        ({"norm_eps": 0.0}, "norm_eps: expected a finite float > 0, found 0.0"),
        ({"n_kv_heads": 3}, "n_kv_heads: expected n_heads (4) to divide by n_kv_heads, found 3"),
        ({"dim": 66}, "dim: expected dim to divide by n_heads (4), found 66"),
        ({"dim": 12, "n_heads": 4}, "dim: expected an even head dim (dim / n_heads)"),
        ({"n_layers": 0}, "n_layers: expected an int >= 1, found 0"),
    ],
)
def test_llama_config_rejects_sizes_that_type_check_but_make_no_model(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Llama.Config(**fields)
    assert str(info.value).startswith(message)
    with pytest.raises(ConfigError) as overridden:
        Llama.Config().apply_overrides([f"{k}={v}" for k, v in fields.items()])
    assert str(overridden.value).startswith(message)


def test_layer_configs_reject_sizes_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^in_features: expected an int >= 1, found 0"):
        Linear.Config(in_features=0)
    with pytest.raises(ConfigError, match=r"^embedding_dim: expected an int >= 1"):
        Embedding.Config(embedding_dim=-1)
    with pytest.raises(ConfigError, match=r"^eps: expected a finite float > 0"):
        RMSNorm.Config(eps=-1e-6)
    with pytest.raises(ConfigError, match=r"^n_heads: Attention: dim \(12\) must divide"):
        Attention.Config(dim=12, n_heads=4, n_kv_heads=3)


class Child(Dense):
    """Declares no Config of its own: Child.Config().build() must not quietly build a Dense."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -super().forward(x)


class Plain(Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_module_subclass_without_its_own_config_cannot_be_built_through_config() -> None:
    with pytest.raises(ConfigError) as info:
        Child.Config().build()
    assert str(info.value) == (
        "Child declares no Config of its own, so Child.Config().build() would build Dense, not "
        "Child; declare `@dataclass(kw_only=True, slots=True) class Config(Dense.Config)` inside "
        "Child"
    )
    with pytest.raises(ConfigError, match=r"^Plain declares no Config of its own.*build Module"):
        Plain.Config().build()
    assert isinstance(Child.Config(), Dense.Config)  # presets made from it still fit Dense
    assert Dense.Config().build().__class__ is Dense


def test_from_nn_module_classes_have_no_config_to_build_from() -> None:
    wrapped = Module.from_nn_module(nn.Linear)
    config = wrapped.Config(
        sharding_config=ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(0)}})
    )
    with pytest.raises(ConfigError) as info:
        config.build()
    assert str(info.value).startswith(
        "Module.from_nn_module(torch.nn.modules.linear.Linear) has no Config to build from: "
        "construct it with its own arguments (Linear(...)), and declare its sharding in its "
        "parent's ShardingConfig with dotted state paths"
    )
    assert isinstance(wrapped(4, 8), nn.Linear)  # constructing it directly still works

"""BaseModel protocol, ModelConfigConverter and the ModelSpec registry (one process)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import (
    BaseModel,
    ModelConfigConverter,
    ModelRegistry,
    ModelSpec,
    Module,
    get_spec,
    register_spec,
    unregister_spec,
)


class Tiny(BaseModel):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        dim: int = 4
        vocab: int = 10
        param_init = {"weight": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = Module.from_nn_module(torch.nn.Embedding)(config.vocab, config.dim)
        self.weight = torch.nn.Parameter(torch.empty(config.dim, config.dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.embed(tokens)
        return embedded @ self.weight


class TinyConverter(ModelConfigConverter[Tiny.Config]):
    def to_config(self, external: Mapping[str, Any]) -> Tiny.Config:
        return Tiny.Config(dim=int(external["hidden_size"]), vocab=int(external["vocab_size"]))

    def from_config(self, config: Tiny.Config) -> dict[str, Any]:
        return {"hidden_size": config.dim, "vocab_size": config.vocab}


def test_base_model_protocol_example() -> None:
    model = (
        Tiny.Config().update_from_config({"model": {"dim": 8}, "training": {"steps": 3}}).build()
    )
    model.verify_module_protocol()
    torch.manual_seed(0)
    model.init_weights()
    assert torch.equal(model.weight, torch.ones(8, 8))
    reference = torch.nn.Embedding(10, 8)
    torch.manual_seed(0)
    reference.reset_parameters()
    assert torch.equal(model.embed.weight, reference.weight)
    nparams, flops = model.config.get_nparams_and_flops(model, seq_len=16)
    assert nparams == 8 * 8 + 10 * 8
    assert flops == 6.0 * 8 * 8  # embeddings are lookups: no FLOPs counted


def test_update_from_config_without_model_section_is_an_equal_copy() -> None:
    config = Tiny.Config(dim=6)
    updated = config.update_from_config({"optimizer": {"lr": 1.0}})
    assert updated == config and updated is not config


def test_update_from_config_unknown_field_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown field 'dimm'.*did you mean 'dim'"):
        Tiny.Config().update_from_config({"model": {"dimm": 3}})
    with pytest.raises(ConfigError, match=r"^model: expected a mapping of model fields, found int"):
        Tiny.Config().update_from_config({"model": 3})


def test_flops_count_tied_parameters_once_and_honour_is_embedding() -> None:
    class Lookup(Module):
        is_embedding = True

        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            param_init = {"table": torch.nn.init.zeros_}  # noqa: RUF012 - a Config field

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.empty(5, 3))

    model = torch.nn.Module()
    model.head = torch.nn.Linear(3, 5, bias=False)
    lookup = Lookup.Config().build()
    model.lookup = lookup
    model.head.weight = lookup.table  # tied: counted once
    model.extra = torch.nn.Linear(3, 3)
    nparams, flops = BaseModel.Config().get_nparams_and_flops(model, seq_len=4)
    assert nparams == 15 + 12
    assert flops == 6.0 * 12
    with pytest.raises(ValueError, match="seq_len must be >= 1, found 0"):
        BaseModel.Config().get_nparams_and_flops(model, seq_len=0)


def test_verify_module_protocol_lists_every_problem() -> None:
    class NoConfig(Tiny):
        pass

    class Broken(BaseModel):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(2))

    with pytest.raises(TypeError) as info:
        Broken.Config().build().verify_module_protocol(strict=True)
    assert isinstance(info.value, RuntimeError)  # upstream's type
    message = str(info.value)
    assert message.startswith("Broken.verify_module_protocol: 2 problem(s):")
    assert "Broken does not define forward()" in message
    assert "Broken.weight: no initializer; Broken.Config.param_init is not set" in message

    with pytest.raises(TypeError, match=r"NoConfig declares no Config of its own"):
        NoConfig(Tiny.Config()).verify_module_protocol(strict=True)


def test_model_config_converter_is_abstract_and_round_trips() -> None:
    class Half(ModelConfigConverter[Tiny.Config]):
        def to_config(self, external: Mapping[str, Any]) -> Tiny.Config:
            return Tiny.Config()

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
    converter = TinyConverter()
    assert converter.to_config({"hidden_size": 6, "vocab_size": 11}) == Tiny.Config(dim=6, vocab=11)
    assert converter.round_trip({"hidden_size": 6, "vocab_size": 11}) == {
        "hidden_size": 6,
        "vocab_size": 11,
    }


def test_model_spec_checks_flavors_and_returns_copies() -> None:
    spec = ModelSpec(
        name="tiny",
        model=Tiny.Config(),
        flavors={"debug": Tiny.Config(dim=2)},
        converter=TinyConverter(),
    )
    config = spec.config("debug")
    assert config == Tiny.Config(dim=2) and config is not spec.flavors["debug"]
    assert spec.config() == Tiny.Config() and spec.config() is not spec.model
    with pytest.raises(
        LookupError, match=r"model 'tiny' has no flavor 'debgu'; did you mean 'debug'"
    ):
        spec.config("debgu")
    with pytest.raises(TypeError, match=r"flavor 'x': expected a BaseModel.Config, found Config"):
        ModelSpec(name="bad", model=Tiny.Config(), flavors={"x": Module.Config()})  # type: ignore[dict-item]


def test_registry_rejects_duplicates_and_suggests_names() -> None:
    registry = ModelRegistry()
    spec = ModelSpec(name="llama-tiny", model=Tiny.Config(), flavors={"debug": Tiny.Config()})
    registry.register(spec)
    assert registry.get("llama-tiny") is spec
    other = ModelSpec(name="llama-tiny", model=Tiny.Config(), flavors={"small": Tiny.Config()})
    with pytest.raises(
        ValueError, match=r"'llama-tiny' is already registered \(flavors \['debug'\]\)"
    ):
        registry.register(other)
    registry.register(other, replace=True)
    assert registry.get("llama-tiny") is other
    with pytest.raises(
        LookupError, match=r"no model named 'llama-tyni'; did you mean 'llama-tiny'"
    ):
        registry.get("llama-tyni")
    registry.unregister("llama-tiny")
    assert registry.names() == []


def test_module_level_registry_functions() -> None:
    spec = ModelSpec(name="test-base-model-tiny", model=Tiny.Config())
    register_spec(spec)
    try:
        assert get_spec("test-base-model-tiny") is spec
    finally:
        unregister_spec("test-base-model-tiny")
    with pytest.raises(LookupError):
        get_spec("test-base-model-tiny")

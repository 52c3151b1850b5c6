"""Module on one process: Config/build, init_states, from_nn_module, containers, signatures."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import (
    MeshAxisName,
    Module,
    ModuleDict,
    ModuleList,
    Sequential,
    ShardingConfig,
)
from hyper_parallel.dmodule._forward import forward_signature
from hyper_parallel.dtensor import Shard


class Linear(Module):
    """The seed docstring's example layer, with the @dataclass decorator."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int = 128
        out_features: int = 64
        param_init = {"weight": torch.nn.init.kaiming_uniform_}  # noqa: RUF012 - a Config field
        sharding_config = ShardingConfig(
            state_shardings={"weight": {MeshAxisName.TP: Shard(0)}},
        )

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.out_features, config.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, None)


class Scaled(Module):
    """A layer with a buffer made by the _init_self_buffers hook and a plain nn child."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 4
        param_init = {"scale": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.empty(config.dim))
        self.proj = torch.nn.Linear(config.dim, config.dim)
        self.register_buffer("offsets", torch.empty(config.dim), persistent=False)

    def _init_self_buffers(self, *, buffer_device: torch.device | str | None = None) -> None:
        self.offsets = torch.arange(self.scale.shape[0], dtype=torch.float32, device=buffer_device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected: torch.Tensor = self.proj(x)
        return projected * self.scale + self.offsets


def test_seed_docstring_example_builds_initialises_and_runs() -> None:
    layer = Linear.Config().build()
    torch.manual_seed(0)
    layer.init_states()
    expected = torch.empty(64, 128)
    torch.manual_seed(0)
    torch.nn.init.kaiming_uniform_(expected)
    assert torch.equal(layer.weight, expected)
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), x @ expected.T)


def test_config_example_with_explicit_fields_attaches_init_and_sharding() -> None:
    sharding = ShardingConfig(state_shardings={"weight": {MeshAxisName.TP: Shard(0)}})
    layer = Linear.Config(
        in_features=128,
        out_features=64,
        param_init={"weight": torch.nn.init.ones_},
        sharding_config=sharding,
    ).build()
    assert layer.sharding_config == sharding
    layer.init_states()
    assert torch.equal(layer.weight, torch.ones(64, 128))


def test_build_copies_param_init_so_templates_are_not_shared() -> None:
    template = Linear.Config()
    layer = template.build()
    assert layer.param_init == template.param_init
    assert layer.param_init is not template.param_init


def test_config_without_dataclass_decorator_is_rejected_naming_the_layer() -> None:
    with pytest.raises(TypeError, match=r"Bad\.Config .*@dataclass\(kw_only=True, slots=True\)"):

        class Bad(Module):
            class Config(Module.Config):
                dim: int = 1


def test_build_rejects_runtime_kwargs_naming_config_fields() -> None:
    with pytest.raises(ConfigError, match="in_features"):
        Linear.Config().build(in_features=3)


def test_init_states_recurses_children_then_own_parameters_then_buffers() -> None:
    layer = Scaled.Config().build()
    torch.manual_seed(1)
    layer.init_states()
    reference = torch.nn.Linear(4, 4)  # plain child: reset_parameters, same seed
    torch.manual_seed(1)
    reference.reset_parameters()
    assert torch.equal(layer.proj.weight, reference.weight)
    assert torch.equal(layer.scale, torch.ones(4))
    assert torch.equal(layer.offsets, torch.arange(4.0))
    assert "offsets" not in layer.state_dict()  # non-persistent kept so


def test_init_states_reaches_modules_inside_plain_containers_in_order() -> None:
    class Stack(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            inner = Linear.Config(in_features=3, out_features=2)
            self.layers = torch.nn.ModuleList([inner.build(), inner.build()])

    model = Stack.Config().build()
    torch.manual_seed(2)
    model.init_states()
    torch.manual_seed(2)
    first, second = torch.empty(2, 3), torch.empty(2, 3)
    torch.nn.init.kaiming_uniform_(first)
    torch.nn.init.kaiming_uniform_(second)
    assert torch.equal(model.layers[0].weight, first)
    assert torch.equal(model.layers[1].weight, second)


def test_init_states_missing_initializer_names_class_and_parameter_and_changes_nothing() -> None:
    class TwoParams(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            param_init = {"weight": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2))
            self.bias = torch.nn.Parameter(torch.zeros(2))

    layer = TwoParams.Config().build()
    with pytest.raises(
        ValueError,
        match=r"TwoParams\.bias: no initializer in TwoParams\.Config\.param_init; it has \['weight'\]",
    ):
        layer.init_states()
    assert torch.equal(layer.weight, torch.zeros(2))  # validated before touching anything


def test_init_states_without_param_init_says_it_is_not_set() -> None:
    class NoInit(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(
        ValueError, match=r"NoInit\.weight: no initializer; NoInit\.Config\.param_init is not set"
    ):
        NoInit.Config().build().init_states()


def test_init_states_lists_every_missing_initializer_with_its_path() -> None:
    class Holder(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.plain = torch.nn.Module()
            self.plain.w = torch.nn.Parameter(torch.zeros(1))  # no reset_parameters
            self.inner = Linear.Config(param_init={}).build()

    with pytest.raises(ValueError) as info:
        Holder.Config().build().init_states()
    message = str(info.value)
    assert (
        "Module.w (at 'plain'): no initializer; a plain Module needs reset_parameters()" in message
    )
    assert (
        "Linear.weight: no initializer in Linear.Config.param_init; it has [] (at 'inner')"
        in message
    )


def test_from_nn_module_is_cached_and_initialises_with_reset_parameters() -> None:
    Conv2d = Module.from_nn_module(torch.nn.Conv2d)
    assert Module.from_nn_module(torch.nn.Conv2d) is Conv2d
    assert issubclass(Conv2d, torch.nn.Conv2d) and issubclass(Conv2d, Module)
    layer = Conv2d(3, 16, kernel_size=3)
    torch.manual_seed(3)
    layer.init_states()
    reference = torch.nn.Conv2d(3, 16, kernel_size=3)
    torch.manual_seed(3)
    reference.reset_parameters()
    assert torch.equal(layer.weight, reference.weight)
    assert layer.bias is not None and reference.bias is not None
    assert torch.equal(layer.bias, reference.bias)


def test_from_nn_module_rejects_non_module_classes() -> None:
    with pytest.raises(TypeError, match="expected a Module subclass, found <class 'int'>"):
        Module.from_nn_module(int)  # type: ignore[arg-type]


def test_containers_are_modules_and_initialise_their_members() -> None:
    from hyper_parallel.dmodule import containers

    assert ModuleList is Module.from_nn_module(torch.nn.ModuleList)
    assert containers.ModuleDict is ModuleDict
    seq = Sequential(Linear.Config(in_features=3, out_features=2).build(), torch.nn.ReLU())
    layers = ModuleDict({"a": seq})
    torch.manual_seed(4)
    layers.init_states()
    expected = torch.empty(2, 3)
    torch.manual_seed(4)
    torch.nn.init.kaiming_uniform_(expected)
    assert torch.equal(seq[0].get_parameter("weight"), expected)
    assert isinstance(layers, Module) and isinstance(seq, torch.nn.Sequential)


def test_unknown_name_raises_attribute_error() -> None:
    import hyper_parallel.dmodule as dmodule

    with pytest.raises(AttributeError, match="has no attribute 'ModuleSet'"):
        dmodule.ModuleSet  # type: ignore[attr-defined]  # noqa: B018


def test_forward_signature_is_read_once_per_class() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: object = None, *, scale: float = 1.0) -> None:
            return None

    first = forward_signature(Net)
    assert first == (("x", "mask"), frozenset({"x", "mask", "scale"}), False)
    assert forward_signature(Net) is first


def test_unparallelized_module_is_freed_without_gc() -> None:
    layer = Linear.Config(in_features=2, out_features=2).build()
    ref = weakref.ref(layer)
    gc.disable()
    try:
        del layer
        assert ref() is None
    finally:
        gc.enable()


def test_subclass_with_its_own_parameter_init_needs_no_param_init() -> None:
    class Custom(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3))

        def _init_self_parameters(self) -> None:
            with torch.no_grad():
                self.weight.fill_(2.0)

    layer = Custom.Config().build()
    layer.init_states()
    assert torch.equal(layer.weight, torch.full((3,), 2.0))

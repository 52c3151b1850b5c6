"""Configurable binding, build() copy semantics, replace, traverse, enforce_module_config_slots."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from hyper_parallel.config import ConfigError, Configurable, enforce_module_config_slots


class Placement:
    """Stand-in for a torch placement: an opaque, immutable leaf object."""

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        object.__setattr__(self, "dim", dim)


@dataclass(frozen=True)
class ShardingConfig:
    """Stand-in for hp-dmodule's frozen ShardingConfig holding dicts of placements."""

    state_shardings: dict[str, dict[str, Placement]] = field(default_factory=dict)


class Attention(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        heads: int = 4

    def __init__(self, *, config: Attention.Config) -> None:
        self.config = config


class FlashAttention(Attention):
    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        block: int = 64


class Block(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        dim: int = 8
        attention: Attention.Config = field(default_factory=Attention.Config)
        sizes: list[int] = field(default_factory=lambda: [1, 2])
        extras: dict[str, list[int]] = field(default_factory=lambda: {"a": [1]})
        param_init: dict[str, Callable[..., Any]] | None = None
        sharding_config: ShardingConfig | None = None

    def __init__(self, *, config: Block.Config, seed: int = 0) -> None:
        self.config = config
        self.seed = seed


class Model(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        layers: list[Block.Config] = field(default_factory=list)
        by_name: dict[str, Block.Config] = field(default_factory=dict)
        pair: tuple[Block.Config, ...] = ()

    def __init__(self, *, config: Model.Config) -> None:
        self.config = config


class SubBlock(Block):
    """Declares no Config: keeps Block.Config, bound to Block."""


def _init_fn(tensor: list[float], std: float = 1.0) -> list[float]:
    return tensor


# ----------------------------------------------------------------------------- binding


def test_config_builds_its_owner_with_runtime_kwargs() -> None:
    block = Block.Config(dim=3).build(seed=7)
    assert type(block) is Block
    assert block.config.dim == 3
    assert block.seed == 7


def test_subclass_config_binds_to_subclass_owner() -> None:
    assert type(FlashAttention.Config().build()) is FlashAttention
    assert type(Attention.Config().build()) is Attention


def test_owner_subclass_without_config_keeps_parent_binding() -> None:
    assert SubBlock.Config is Block.Config
    assert type(SubBlock.Config().build()) is Block


def test_config_preset_outside_an_owner_builds_the_parent_owner() -> None:
    @dataclass(kw_only=True, slots=True)
    class WideBlockConfig(Block.Config):
        dim: int = 1024

    built = WideBlockConfig().build()
    assert type(built) is Block
    assert type(built.config) is WideBlockConfig


def test_config_without_owner_raises_clear_error() -> None:
    @dataclass(kw_only=True, slots=True)
    class Orphan(Configurable.Config):
        x: int = 0

    with pytest.raises(ConfigError, match=r"Orphan has no owner to build.*inside a Configurable"):
        Orphan().build()


def test_owner_config_must_subclass_configurable_config() -> None:
    with pytest.raises(
        TypeError, match=r"Bad\.Config: expected a subclass of Configurable\.Config"
    ):

        class Bad(Configurable):
            @dataclass(kw_only=True, slots=True)
            class Config:
                x: int = 0


def test_reusing_another_owners_config_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"already bound to Block; declare `class Config\(Block"):

        class Thief(Configurable):
            Config = Block.Config


def test_multiple_inheritance_with_a_metaclass_base_works() -> None:
    class FrameworkMeta(type):
        pass

    class FrameworkModule(metaclass=FrameworkMeta):  # a framework base with a metaclass
        def __init__(self) -> None:
            self.initialised = True

    class Module(FrameworkModule, Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            param_init: dict[str, Callable[..., Any]] | None = None

        def __init__(self, *, config: Module.Config) -> None:
            super().__init__()
            self.config = config

    built = Module.Config().build()
    assert isinstance(built, FrameworkModule)
    assert built.initialised


def test_overriding_build_can_call_the_base_build_explicitly() -> None:
    class Module(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            width: int = 2

            def build(self, **kwargs: Any) -> Any:
                built = Configurable.Config.build(self, **kwargs)
                built.extra = "post-build"
                return built

        def __init__(self, *, config: Module.Config) -> None:
            self.config = config
            self.extra = ""

    class Linear(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            width: int = 5

    built = Linear.Config().build()
    assert type(built) is Linear
    assert built.extra == "post-build"
    assert built.config.width == 5


# ----------------------------------------------------------------------------- build copy


def test_build_copies_nested_configs_lists_and_dicts() -> None:
    template = Model.Config(layers=[Block.Config()], by_name={"x": Block.Config()})
    built = template.build().config
    assert built == template
    assert built is not template
    assert built.layers is not template.layers
    assert built.layers[0] is not template.layers[0]
    assert built.layers[0].attention is not template.layers[0].attention
    assert built.layers[0].sizes is not template.layers[0].sizes
    assert built.layers[0].extras["a"] is not template.layers[0].extras["a"]
    assert built.by_name["x"] is not template.by_name["x"]
    built.layers[0].sizes.append(3)
    built.layers[0].attention.heads = 99
    assert template.layers[0].sizes == [1, 2]
    assert template.layers[0].attention.heads == 4


def test_build_copies_configs_inside_tuples() -> None:
    template = Model.Config(pair=(Block.Config(), Block.Config()))
    built = template.build().config
    assert all(a is not b for a, b in zip(built.pair, template.pair, strict=True))


def test_build_keeps_callables_partials_and_placements_as_they_are() -> None:
    init = functools.partial(_init_fn, std=0.02)
    shard = Placement(0)
    sharding = ShardingConfig(state_shardings={"weight": {"tp": shard}})
    template = Block.Config(param_init={"weight": _init_fn, "bias": init}, sharding_config=sharding)
    built = template.build().config
    assert built.param_init is not None and template.param_init is not None
    assert built.param_init is not template.param_init
    assert built.param_init["weight"] is _init_fn
    assert built.param_init["bias"] is init
    assert built.sharding_config is not None
    assert built.sharding_config.state_shardings["weight"]["tp"] is shard
    # the frozen dataclass holds dicts, so it is copied and its dicts are not shared
    assert built.sharding_config.state_shardings is not sharding.state_shardings


def test_build_copies_a_shared_sub_config_once_per_place_it_appears() -> None:
    # configs are values: a sub-config used twice builds as two equal, independent configs,
    # the same as to_dict/from_dict and apply_overrides see it
    shared = Block.Config()
    built = Model.Config(layers=[shared, shared]).build().config
    assert built.layers[0] == built.layers[1] == shared
    assert built.layers[0] is not built.layers[1]
    assert id(shared) not in {id(layer) for layer in built.layers}


def test_build_rejects_runtime_kwargs_naming_config_fields() -> None:
    with pytest.raises(ConfigError, match=r"found 'attention', 'dim' naming config fields") as err:
        Block.Config().build(dim=3, attention=None, seed=1)
    assert isinstance(err.value, ValueError)


def test_build_rejects_config_kwarg() -> None:
    with pytest.raises(ConfigError, match=r"found 'config'"):
        Block.Config().build(config=Block.Config())


# ----------------------------------------------------------------------------- declaring


def test_plain_class_attribute_overrides_an_inherited_field() -> None:
    class Wide(Block):
        @dataclass(kw_only=True, slots=True)
        class Config(Block.Config):
            dim = 64
            param_init = {"weight": _init_fn}  # noqa: RUF012 - becomes a field

    first, second = Wide.Config(), Wide.Config()
    assert first.dim == 64
    assert first.param_init == {"weight": _init_fn}
    assert first.param_init is not second.param_init
    assert "dim" in {f.name for f in dataclasses.fields(Wide.Config)}
    assert Wide.Config(dim=3).dim == 3


def test_mutable_defaults_are_copied_per_instance() -> None:
    @dataclass(kw_only=True, slots=True)
    class WithDefaults(Configurable.Config):
        sizes: list[int] = [1, 2]  # noqa: RUF008 - hp-config turns this into a factory
        attention: Attention.Config = Attention.Config(heads=2)  # noqa: RUF009

    a, b = WithDefaults(), WithDefaults()
    assert a.sizes == [1, 2]
    assert a.sizes is not b.sizes
    assert a.attention == Attention.Config(heads=2)
    assert a.attention is not b.attention


def test_slots_reject_misspelt_attributes() -> None:
    config = Block.Config()
    with pytest.raises(AttributeError):
        config.dimm = 3  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- replace


def test_replace_returns_a_deep_copy_with_changes() -> None:
    template = Block.Config()
    changed = template.replace(dim=5)
    assert changed.dim == 5
    assert template.dim == 8
    assert changed.attention == template.attention
    assert changed.attention is not template.attention
    assert changed.sizes is not template.sizes


def test_replace_unknown_field_suggests_the_closest_name() -> None:
    with pytest.raises(
        ConfigError, match=r"^dimm: unknown field 'dimm' for Block\.Config; did you mean 'dim'\?"
    ):
        Block.Config().replace(dimm=3)


# ----------------------------------------------------------------------------- traverse


def _tree() -> Model.Config:
    return Model.Config(
        layers=[Block.Config(), Block.Config(attention=FlashAttention.Config())],
        by_name={"head": Block.Config()},
        pair=(Block.Config(),),
    )


def test_traverse_yields_fqn_parent_and_key_of_matching_configs() -> None:
    config = _tree()
    found = list(config.traverse(Attention.Config))
    assert [fqn for fqn, *_ in found] == [
        "layers.0.attention",
        "layers.1.attention",
        "by_name.head.attention",
        "pair.0.attention",
    ]
    for _fqn, node, parent, key in found:
        assert getattr(parent, str(key)) is node
        assert isinstance(node, Attention.Config)
    assert found[1][1] is config.layers[1].attention


def test_traverse_reports_container_parents_and_root() -> None:
    config = _tree()
    found = {fqn: (node, parent, key) for fqn, node, parent, key in config.traverse()}
    assert found[""] == (config, None, None)
    assert found["layers.1"] == (config.layers[1], config.layers, 1)
    assert found["by_name.head"] == (config.by_name["head"], config.by_name, "head")
    assert found["pair.0"] == (config.pair[0], config.pair, 0)


def test_traverse_allows_replacing_nodes_in_place() -> None:
    config = _tree()
    for _, node, parent, key in config.traverse(Attention.Config):
        if not isinstance(node, FlashAttention.Config) and not isinstance(parent, tuple):
            setattr(parent, str(key), FlashAttention.Config(heads=node.heads))
    kinds = [type(n) for _, n, _, _ in config.traverse(Attention.Config)]
    assert kinds[:3] == [FlashAttention.Config] * 3


# ----------------------------------------------------------------------------- slots check


def test_enforce_module_config_slots_accepts_kw_only_slotted_dataclass() -> None:
    enforce_module_config_slots(Block.Config, "Block")


def test_enforce_module_config_slots_rejects_missing_slots() -> None:
    @dataclass(kw_only=True)
    class NoSlots(Configurable.Config):
        x: int = 0

    with pytest.raises(
        TypeError, match=r"Linear\.Config .*missing __slots__ on .*NoSlots \(use slots=True\)"
    ):
        enforce_module_config_slots(NoSlots, "Linear")


def test_enforce_module_config_slots_rejects_positional_fields() -> None:
    @dataclass(slots=True)
    class Positional(Configurable.Config):
        x: int = 0

    with pytest.raises(
        TypeError, match=r"Linear\.Config .*keyword-only fields x \(use kw_only=True\)"
    ):
        enforce_module_config_slots(Positional, "Linear")


def test_enforce_module_config_slots_rejects_undecorated_class() -> None:
    class Undecorated(Block.Config):
        pass

    with pytest.raises(TypeError, match=r"Linear\.Config .*not itself a dataclass"):
        enforce_module_config_slots(Undecorated, "Linear")


def test_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, hyper_parallel.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_math_callables_are_kept_in_build() -> None:
    config = Block.Config(param_init={"w": math.sqrt})
    assert config.build().config.param_init == {"w": math.sqrt}

"""Bad input a Config refuses when it is made: wrong types, cycles, and what a shared sub-config means."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Annotated, Any, Literal

import pytest

from hyper_parallel.config import (
    ConfigError,
    ConfigTypeError,
    Configurable,
    LeafCodec,
    UnboundConfigError,
    dataclass_from_dict,
    dataclass_to_dict,
)

FRACTION = LeafCodec(Fraction, str, Fraction, "a fraction such as '1/3'")


class Leaf(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        dim: int = 4
        scale: float = 1.0
        name: str = "leaf"
        mode: Literal["a", "b"] = "a"
        sizes: list[int] = field(default_factory=lambda: [1, 2])
        by_name: dict[str, int] = field(default_factory=dict)
        init: Callable[..., Any] | None = None
        ratio: Annotated[Fraction, FRACTION] = Fraction(1, 2)

        def validate(self) -> None:
            if self.dim < 1:
                raise ConfigError(f"expected an int >= 1, found {self.dim}", path="dim")

    def __init__(self, *, config: Leaf.Config) -> None:
        self.config = config


class Tree(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        left: Leaf.Config = field(default_factory=Leaf.Config)
        right: Leaf.Config = field(default_factory=Leaf.Config)
        leaves: list[Leaf.Config] = field(default_factory=list)

    def __init__(self, *, config: Tree.Config) -> None:
        self.config = config
        self.left = config.left.build()
        self.right = config.right.build()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": "4"}, "dim: expected int, found str '4'"),
        ({"dim": True}, "dim: expected int, found bool True"),
        ({"scale": "fast"}, "scale: expected float, found str 'fast'"),
        ({"mode": "c"}, "mode: expected one of 'a', 'b', found str 'c'"),
        ({"sizes": [1, "2"]}, "sizes.1: expected int, found str '2'"),
        ({"sizes": (1, 2)}, "sizes: expected list[int], found tuple (1, 2)"),
        ({"by_name": {"a": 1.5}}, "by_name.a: expected int, found float 1.5"),
        ({"init": 0.02}, "init: expected Callable[..., Any] | None, found float 0.02"),
        ({"ratio": 0.5}, "ratio: expected a fraction such as '1/3', found float 0.5"),
    ],
)
def test_constructor_and_replace_reject_wrong_types_naming_the_field(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigTypeError) as made:
        Leaf.Config(**changes)
    assert str(made.value) == message
    assert isinstance(made.value, TypeError) and isinstance(made.value, ValueError)
    template = Leaf.Config()
    with pytest.raises(ConfigTypeError) as replaced:
        template.replace(**changes)
    assert str(replaced.value) == message
    assert template == Leaf.Config()  # the failed replace changed nothing


def test_an_int_is_a_fine_float_and_none_fits_optional() -> None:
    config = Leaf.Config(scale=2, init=None)
    assert config.scale == 2


def test_validate_hook_rejects_values_that_type_check_with_the_full_path() -> None:
    with pytest.raises(ConfigError, match=r"^dim: expected an int >= 1, found 0$"):
        Leaf.Config(dim=0)
    with pytest.raises(ConfigError, match=r"^left\.dim: expected an int >= 1, found 0$"):
        Tree.Config.from_dict({"left": {"dim": 0}})
    with pytest.raises(ConfigError, match=r"^leaves\.1\.dim: expected an int >= 1, found -2$"):
        Tree.Config(leaves=[Leaf.Config(), Leaf.Config()]).apply_overrides(["leaves.1.dim=-2"])


def test_build_without_an_owner_raises_upstreams_not_implemented_error() -> None:
    with pytest.raises(NotImplementedError) as info:
        Configurable.Config().build()
    assert isinstance(info.value, UnboundConfigError) and isinstance(info.value, ConfigError)
    assert "has no owner to build" in str(info.value)


def _cyclic() -> Tree.Config:
    config = Tree.Config(leaves=[Leaf.Config()])
    config.leaves.append(config)  # type: ignore[arg-type]
    return config


def test_a_cyclic_config_is_an_error_in_to_dict_traverse_and_build() -> None:
    config = _cyclic()
    with pytest.raises(ConfigError, match=r"^leaves\.1: cannot convert a cyclic config.*'<root>'"):
        config.to_dict()
    with pytest.raises(ConfigError, match=r"^leaves\.1: cannot traverse a cyclic config"):
        list(config.traverse())
    with pytest.raises(ConfigError, match=r"^leaves\.1: cannot copy a cyclic config"):
        config.build()
    with pytest.raises(ConfigError, match="cyclic"):
        config.apply_overrides(["left.dim=3"])


def test_a_shared_sub_config_is_two_values_for_overrides_build_and_to_dict() -> None:
    shared = Leaf.Config(dim=2)
    config = Tree.Config(left=shared, right=shared)
    # an override changes the one path it names...
    changed = config.apply_overrides(["left.dim=8"])
    assert (changed.left.dim, changed.right.dim) == (8, 2)
    # ...build() gives each place its own copy (a later change to one leaves the other)...
    built = config.build()
    assert built.config.left is not built.config.right
    built.config.left.dim = 9
    assert built.config.right.dim == 2 and shared.dim == 2
    # ...and to_dict/from_dict see two equal, separate configs as well
    rebuilt = Tree.Config.from_dict(json.loads(json.dumps(config.to_dict())))
    assert rebuilt == config and rebuilt.left is not rebuilt.right
    # traverse names both places
    assert [fqn for fqn, *_ in config.traverse(Leaf.Config)] == ["left", "right"]


def test_leaf_codec_round_trips_and_parses_overrides() -> None:
    config = Leaf.Config(ratio=Fraction(2, 3))
    data = config.to_dict()
    assert data["ratio"] == "2/3"
    assert Leaf.Config.from_dict(data) == config
    assert Leaf.Config().apply_overrides(["ratio=3/4"]).ratio == Fraction(3, 4)
    with pytest.raises(ConfigError, match=r"^ratio: expected a fraction such as '1/3', found"):
        Leaf.Config().apply_overrides(["ratio=three"])


def test_dataclass_to_and_from_dict_work_for_plain_dataclasses() -> None:
    @dataclass(frozen=True)
    class Span:
        ratio: Annotated[Fraction, FRACTION]
        sizes: tuple[int, ...] = ()

    span = Span(Fraction(1, 3), (1, 2))
    assert dataclass_to_dict(span) == {"ratio": "1/3", "sizes": [1, 2]}
    assert dataclass_from_dict(Span, {"ratio": "1/3", "sizes": [1, 2]}) == span
    with pytest.raises(TypeError, match="expected a dataclass instance"):
        dataclass_to_dict(3)

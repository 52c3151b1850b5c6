"""Upstream hyper-parallel's own Configurable unit tests (tests/ut/config), ported to this API.

Differences kept on purpose (see the README): ``build()`` copies deeply, not with
``dataclasses.replace``; ``to_dict`` writes data ``from_dict`` reads back, not ``repr`` strings.
"""

# No `from __future__ import annotations`: as upstream's file, the local Configs of
# test_to_dict_two_layer keep real annotations that to_dict can resolve.
import json
from dataclasses import dataclass, field

import pytest

from hyper_parallel.config import Configurable


class OldStyleComponent(Configurable):
    """__init__ takes extra runtime kwargs (not config fields)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        x: int = 5

    def __init__(self, config: "OldStyleComponent.Config", *, dim: int) -> None:
        self.config = config
        self.dim = dim


class NoKwargsComponent(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        x: int = 5

    def __init__(self, config: "NoKwargsComponent.Config") -> None:
        self.config = config


class Leaf(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        value: int = 1

    def __init__(self, config: "Leaf.Config") -> None:
        self.config = config


class Tree(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        leaf: "Leaf.Config"
        leaves: "list[Leaf.Config]"

    def __init__(self, config: "Tree.Config") -> None:
        self.config = config


def test_build_constructs_owner() -> None:
    obj = Leaf.Config(value=7).build()
    assert isinstance(obj, Leaf) and obj.config.value == 7


def test_replace_does_not_mutate_original() -> None:
    cfg = Leaf.Config(value=3)
    assert cfg.replace(value=9).value == 9 and cfg.value == 3


def test_traverse_nested_configs() -> None:
    tree = Tree.Config(
        leaf=Leaf.Config(value=1), leaves=[Leaf.Config(value=2), Leaf.Config(value=3)]
    )
    assert [fqn for fqn, _, _, _ in tree.traverse(Leaf.Config)] == ["leaf", "leaves.0", "leaves.1"]


def test_to_dict_json_serializable() -> None:
    payload = Tree.Config(leaf=Leaf.Config(value=4), leaves=[Leaf.Config(value=5)]).to_dict()
    json.dumps(payload)
    assert payload["leaf"]["value"] == 4  # type: ignore[index, call-overload]
    assert payload["leaves"][0]["value"] == 5  # type: ignore[index, call-overload]


def test_old_style_forwarding_and_clone_isolation() -> None:
    cfg = OldStyleComponent.Config(x=10)
    obj = cfg.build(dim=64)
    assert isinstance(obj, OldStyleComponent) and (obj.config.x, obj.dim) == (10, 64)
    obj.config.x = 999
    assert cfg.x == 10


def test_no_kwargs_build_and_clone_isolation() -> None:
    cfg = NoKwargsComponent.Config(x=42)
    obj = cfg.build()
    assert isinstance(obj, NoKwargsComponent) and obj.config.x == 42
    obj.config.x = 999
    assert cfg.x == 42


def test_build_without_owner_raises() -> None:
    with pytest.raises(NotImplementedError):
        Configurable.Config().build()


def test_build_kwargs_overlap_config_fields_raises() -> None:
    with pytest.raises(ValueError, match="overlap"):
        OldStyleComponent.Config(x=1).build(dim=2, x=3)


def test_to_dict_two_layer() -> None:
    class Inner(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            a: int = 1
            b: int = 2

        def __init__(self, config: "Inner.Config") -> None:
            self.config = config

    class Outer(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            x: int = 10
            inner: Inner.Config = field(default_factory=Inner.Config)

        def __init__(self, config: "Outer.Config") -> None:
            self.config = config

    payload = Outer.Config(x=42).to_dict()
    assert payload == {"x": 42, "inner": {"a": 1, "b": 2}}


def test_repr() -> None:
    assert "x=42" in repr(NoKwargsComponent.Config(x=42))


def test_plain_config_without_slots_allowed() -> None:
    """A Configurable that is not a Module may declare its Config without slots=True."""

    class PlainComponent(Configurable):
        @dataclass(kw_only=True)
        class Config(Configurable.Config):
            x: int = 1

        def __init__(self, config: "PlainComponent.Config") -> None:
            self.config = config

    assert PlainComponent.Config(x=2).build().config.x == 2

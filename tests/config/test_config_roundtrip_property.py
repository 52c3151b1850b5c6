"""Property: from_dict(to_dict(c)) == c over generated config trees, and to_dict is JSON."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.config import Configurable


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass(kw_only=True, slots=True)
class Leaf(Configurable.Config):
    count: int = 0
    scale: float = 1.0
    name: str = ""
    flag: bool = False
    color: Color = Color.RED
    level: Level = Level.LOW
    mode: Literal["train", "eval"] = "train"
    shape: tuple[int, ...] = ()
    pair: tuple[int, str] = (0, "")
    tags: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    maybe: int | None = None
    either: int | str = 0
    activation: Callable[[float], float] = math.sqrt


@dataclass(kw_only=True, slots=True)
class TaggedLeaf(Leaf):
    extra: float = 0.0


@dataclass(kw_only=True, slots=True)
class Tree(Configurable.Config):
    leaf: Leaf = field(default_factory=Leaf)
    children: list[Tree] = field(default_factory=list)
    named: dict[str, Leaf] = field(default_factory=dict)
    optional: Leaf | None = None


_floats = st.floats(allow_nan=False, allow_infinity=False)
_text = st.text(max_size=6)
_leaf_fields = {
    "count": st.integers(),
    "scale": _floats,
    "name": _text,
    "flag": st.booleans(),
    "color": st.sampled_from(Color),
    "level": st.sampled_from(Level),
    "mode": st.sampled_from(["train", "eval"]),
    "shape": st.lists(st.integers(), max_size=3).map(tuple),
    "pair": st.tuples(st.integers(), _text),
    "tags": st.lists(_text, max_size=3),
    "weights": st.dictionaries(_text, _floats, max_size=3),
    "maybe": st.none() | st.integers(),
    "either": st.integers() | _text,
    "activation": st.sampled_from([math.sqrt, math.exp, abs]),
}
leaves = st.builds(Leaf, **_leaf_fields) | st.builds(TaggedLeaf, extra=_floats, **_leaf_fields)
trees = st.recursive(
    st.builds(Tree, leaf=leaves),
    lambda children: st.builds(
        Tree,
        leaf=leaves,
        children=st.lists(children, max_size=3),
        named=st.dictionaries(_text, leaves, max_size=2),
        optional=st.none() | leaves,
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_from_dict_of_to_dict_rebuilds_the_exact_tree(tree: Tree) -> None:
    data = tree.to_dict()
    text = json.dumps(data, allow_nan=False)
    assert Tree.from_dict(data) == tree
    rebuilt = Tree.from_dict(json.loads(text))
    assert rebuilt == tree
    assert [type(n) for _, n, _, _ in rebuilt.traverse()] == [
        type(n) for _, n, _, _ in tree.traverse()
    ]


@settings(max_examples=30, deadline=None)
@given(trees)
def test_build_style_copy_equals_but_does_not_share(tree: Tree) -> None:
    copied = tree.replace()
    assert copied == tree
    originals = {id(n) for _, n, _, _ in tree.traverse()}
    assert all(id(n) not in originals for _, n, _, _ in copied.traverse())

"""to_dict / from_dict: data format, type tags, callables and the annotation coercion matrix."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import pytest

from hyper_parallel.config import ConfigError, Configurable


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Opaque(enum.Enum):
    """An enum whose values are not JSON scalars: encoded by name."""

    A = (1, 2)
    B = (3, 4)


@dataclass(kw_only=True, slots=True)
class Attention(Configurable.Config):
    heads: int = 4


@dataclass(kw_only=True, slots=True)
class Flash(Attention):
    block: int = 64


@dataclass(kw_only=True, slots=True)
class Other(Configurable.Config):
    heads: int = 4


@dataclass(kw_only=True, slots=True)
class Block(Configurable.Config):
    dim: int
    attention: Attention = field(default_factory=Attention)
    init: Callable[..., Any] | None = None


@dataclass(kw_only=True, slots=True)
class Model(Configurable.Config):
    layers: list[Block] = field(default_factory=list)
    heads: dict[str, Attention] = field(default_factory=dict)
    anything: Any = None
    kind: type[Attention] = Attention


def _holder(annotation: object) -> type[Any]:
    """A config class with one field ``value`` annotated ``annotation``."""
    return dataclasses.make_dataclass(
        "Holder",
        [("value", annotation, field(default=None))],
        bases=(Configurable.Config,),
        kw_only=True,
        slots=True,
    )


def _decode(annotation: object, data: object) -> Any:
    return _holder(annotation).from_dict({"value": data}).value


def _scale(value: object, factor: float = 1.0) -> object:
    return value


# ----------------------------------------------------------------------------- coercion matrix

ACCEPTED = [
    (int, 3, 3),
    (float, 2, 2.0),
    (float, 2.5, 2.5),
    (bool, True, True),
    (str, "x", "x"),
    (Optional[int], None, None),  # noqa: UP045 - typing spelling on purpose
    (Optional[int], 4, 4),  # noqa: UP045 - typing spelling on purpose
    (int | None, None, None),
    (Literal["a", "b"], "b", "b"),
    (Literal[1, 2], 2, 2),
    (Color, "blue", Color.BLUE),
    (Color, "BLUE", Color.BLUE),
    (Level, 2, Level.HIGH),
    (Level, "HIGH", Level.HIGH),
    (Opaque, "B", Opaque.B),
    (tuple[int, str], [1, "a"], (1, "a")),
    (tuple[int, ...], [1, 2, 3], (1, 2, 3)),
    (tuple[int, ...], [], ()),
    (list[float], [1, 2.5], [1.0, 2.5]),
    (list[list[int]], [[1], []], [[1], []]),
    (dict[str, int], {"a": 1}, {"a": 1}),
    (dict[int, str], {"3": "x"}, {3: "x"}),
    (dict[Color, int], {"red": 1}, {Color.RED: 1}),
    (int | str, "3", "3"),
    (int | str, 3, 3),
    (Union[float, int], 3, 3),  # noqa: UP007 - typing spelling on purpose
    (float | int, 2.5, 2.5),
    (Any, {"a": [1]}, {"a": [1]}),
    (Callable[..., Any], {"_callable_": "math:sqrt"}, math.sqrt),
    (Callable[..., Any], "math:sqrt", math.sqrt),
    (type[Attention], {"_callable_": f"{__name__}:Flash"}, Flash),
]


@pytest.mark.parametrize(("annotation", "data", "expected"), ACCEPTED)
def test_from_dict_coerces_by_annotation(
    annotation: object, data: object, expected: object
) -> None:
    value = _decode(annotation, data)
    assert value == expected
    assert type(value) is type(expected)


REJECTED = [
    (int, "1", "expected int, found str '1'"),
    (int, True, "expected int, found bool True"),
    (int, 1.5, "expected int, found float 1.5"),
    (float, "1.5", "expected float, found str '1.5'"),
    (float, False, "expected float, found bool False"),
    (bool, 1, "expected bool, found int 1"),
    (bool, "true", "expected bool, found str 'true'"),
    (str, 3, "expected str, found int 3"),
    (int, None, "expected int, found NoneType None"),
    (Literal["a", "b"], "c", "expected one of 'a', 'b', found str 'c'"),
    (Literal[1], True, "expected one of 1, found bool True"),
    (Color, "green", "expected Color: one of RED ('red'), BLUE ('blue'), found str 'green'"),
    (tuple[int, str], [1], "expected tuple[int, str] (2 items), found 1 items"),
    (tuple[int, ...], "12", "expected tuple[int, ...], found str '12'"),
    (list[int], {"a": 1}, "expected list[int], found dict"),
    (dict[str, int], [1], "expected dict[str, int], found list"),
    (int | None, "x", "expected int | None, found str 'x'"),
    (Callable[..., Any], "math:nope", "cannot import 'math:nope'"),
    (Callable[..., Any], "math:pi", "expected a callable, found float 3.14"),
    (Callable[..., Any], 3, "expected an importable callable as 'module:qualname', found int 3"),
    (type[Attention], "builtins:dict", "expected a subclass of Attention, found type"),
]


@pytest.mark.parametrize(("annotation", "data", "message"), REJECTED)
def test_from_dict_rejects_mismatched_json_types(
    annotation: object, data: object, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _decode(annotation, data)
    text = str(err.value)
    assert text.startswith("value: ")  # the path comes first
    assert message in text


def test_list_item_errors_name_the_index() -> None:
    with pytest.raises(ConfigError, match=r"^value\.1: expected int, found str 'x'$"):
        _decode(list[int], [1, "x"])


# ----------------------------------------------------------------------------- to_dict format


def test_to_dict_is_json_data_with_tuples_as_lists_and_enums_by_value() -> None:
    holder = _holder(Any)(value={"t": (1, 2), "c": Color.RED, "l": Level.HIGH, "o": Opaque.A})
    data = holder.to_dict()
    assert data == {"value": {"t": [1, 2], "c": "red", "l": 2, "o": "A"}}
    assert json.loads(json.dumps(data)) == data


def test_to_dict_tags_subclasses_of_the_declared_type_only() -> None:
    model = Model(layers=[Block(dim=1), Block(dim=2, attention=Flash(block=8))])
    data = model.to_dict()
    layers = data["layers"]
    assert isinstance(layers, list)
    assert layers[0] == {"dim": 1, "attention": {"heads": 4}, "init": None}
    assert layers[1] == {
        "dim": 2,
        "attention": {"_type_": f"{__name__}:Flash", "heads": 4, "block": 8},
        "init": None,
    }
    rebuilt = Model.from_dict(data)
    assert rebuilt == model
    assert type(rebuilt.layers[1].attention) is Flash


def test_to_dict_encodes_importable_callables_and_classes() -> None:
    model = Model(layers=[Block(dim=1, init=math.sqrt)], kind=Flash)
    data = model.to_dict()
    assert data["kind"] == {"_callable_": f"{__name__}:Flash"}
    assert data["layers"] == [
        {"dim": 1, "attention": {"heads": 4}, "init": {"_callable_": "math:sqrt"}}
    ]
    assert Model.from_dict(data) == model


def test_to_dict_rejects_lambdas_naming_the_path() -> None:
    model = Model(layers=[Block(dim=1), Block(dim=2, init=lambda x: x)])
    with pytest.raises(
        ConfigError,
        match=r"^layers\.1\.init: cannot convert callable to JSON data: expected an importable function",
    ):
        model.to_dict()


def test_to_dict_rejects_unknown_objects_naming_the_path() -> None:
    with pytest.raises(
        ConfigError, match=r"^value\.x: cannot convert to JSON data: expected .*found object"
    ):
        _holder(Any)(value={"x": object()}).to_dict()


def test_partial_round_trips_when_its_arguments_are_json() -> None:
    init = functools.partial(math.pow, 2.0)
    data = Block(dim=1, init=init).to_dict()
    assert data["init"] == {"_partial_": "math:pow", "args": [2.0], "kwargs": {}}
    rebuilt = Block.from_dict(data).init
    assert isinstance(rebuilt, functools.partial)
    assert rebuilt.func is math.pow and rebuilt.args == (2.0,) and rebuilt(3) == init(3)


def test_partial_with_non_json_arguments_raises() -> None:
    init = functools.partial(_scale, object())
    with pytest.raises(ConfigError, match=r"^init\.args\.0: cannot convert to JSON data"):
        Block(dim=1, init=init).to_dict()


# ----------------------------------------------------------------------------- from_dict rules


def test_from_dict_missing_keys_take_defaults() -> None:
    assert Block.from_dict({"dim": 5}) == Block(dim=5)


def test_from_dict_missing_required_field_names_it() -> None:
    with pytest.raises(
        ConfigError, match=r"^layers\.0: missing required field\(s\) 'dim' of Block"
    ):
        Model.from_dict({"layers": [{}]})


def test_from_dict_unknown_key_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigError) as err:
        Model.from_dict({"layers": [{"dim": 1, "atention": {}}]})
    text = str(err.value)
    assert text.startswith("layers.0.atention: unknown field 'atention' for Block")
    assert "did you mean 'attention'?" in text


def test_from_dict_nested_type_error_names_full_path() -> None:
    with pytest.raises(ConfigError, match=r"^heads\.main\.heads: expected int, found str 'many'$"):
        Model.from_dict({"heads": {"main": {"heads": "many"}}})


def test_type_tag_naming_a_non_subclass_is_rejected() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^layers\.0\.attention\._type_: expected Attention or a subclass of it, found '.*:Other'",
    ):
        Model.from_dict({"layers": [{"dim": 1, "attention": {"_type_": f"{__name__}:Other"}}]})


def test_type_tag_naming_an_arbitrary_importable_object_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"found 'os:system' \(tags only name subclasses"):
        Model.from_dict({"layers": [{"dim": 1, "attention": {"_type_": "os:system"}}]})


def test_type_tag_under_any_is_limited_to_configs() -> None:
    data = {"anything": {"_type_": f"{__name__}:Flash", "block": 2}}
    assert Model.from_dict(data).anything == Flash(block=2)
    with pytest.raises(
        ConfigError,
        match=r"^anything._type_: expected Configurable.Config or a subclass of it, found .collections:OrderedDict.",
    ):
        Model.from_dict({"anything": {"_type_": "collections:OrderedDict"}})


def test_root_type_tag_selects_a_subclass() -> None:
    assert type(Attention.from_dict({"_type_": f"{__name__}:Flash"})) is Flash


def test_from_dict_root_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^<root>: expected Block, found list"):
        Block.from_dict([1])  # type: ignore[arg-type]


def test_post_init_errors_become_config_errors_with_path() -> None:
    @dataclass(kw_only=True, slots=True)
    class Positive(Configurable.Config):
        n: int = 1

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError(f"n must be positive, got {self.n}")

    holder = _holder(Positive)
    with pytest.raises(
        ConfigError, match=r"^value: Positive\(\.\.\.\) rejected the values: n must be positive"
    ):
        holder.from_dict({"value": {"n": -1}})


def test_string_annotations_resolve_under_future_import() -> None:
    # this module uses `from __future__ import annotations`: every annotation is a string
    assert isinstance(Block.__dataclass_fields__["dim"].type, str)
    assert Block.from_dict({"dim": 2}).dim == 2

"""apply_overrides parsing by annotation, parse_cli_overrides, load_config (JSON / TOML)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

from hyper_parallel.config import ConfigError, Configurable, load_config, parse_cli_overrides


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass(kw_only=True, slots=True)
class Layer(Configurable.Config):
    dim: int = 8
    dropout: float = 0.0
    bias: bool = True


@dataclass(kw_only=True, slots=True)
class Optim(Configurable.Config):
    lr: float = 1e-3
    name: str = "adam"


@dataclass(kw_only=True, slots=True)
class Model(Configurable.Config):
    layers: list[Layer] = field(default_factory=lambda: [Layer(), Layer()])
    optim: Optim = field(default_factory=Optim)
    heads: dict[str, Layer] = field(default_factory=lambda: {"main": Layer()})
    limits: dict[str, int] = field(default_factory=dict)
    pair: tuple[Layer, Layer] = field(default_factory=lambda: (Layer(), Layer()))
    maybe: Optional[Layer] = None  # noqa: UP045 - typing spelling on purpose
    computed: int = field(default=0, init=False)


def _holder(annotation: object) -> type[Any]:
    return dataclasses.make_dataclass(
        "Holder",
        [("value", annotation, field(default=None))],
        bases=(Configurable.Config,),
        kw_only=True,
        slots=True,
    )


def _parse(annotation: object, text: str) -> Any:
    holder = _holder(annotation)
    # None fits no annotation here; start from an instance made without the constructor's
    # type check (the override's replace() checks the parsed value)
    blank = object.__new__(holder)
    object.__setattr__(blank, "value", None)
    return blank.apply_overrides([f"value={text}"]).value


# ----------------------------------------------------------------------------- text parsing

PARSED = [
    (int, "32", 32),
    (int, "-4", -4),
    (float, "0.1", 0.1),
    (float, "1e-3", 1e-3),
    (float, "2", 2.0),
    (bool, "true", True),
    (bool, "False", False),
    (bool, "1", True),
    (bool, "0", False),
    (bool, "yes", True),
    (bool, "no", False),
    (str, "adamw", "adamw"),
    (str, '"none"', "none"),
    (Optional[int], "none", None),  # noqa: UP045 - typing spelling on purpose
    (Optional[int], "null", None),  # noqa: UP045 - typing spelling on purpose
    (Optional[int], "5", 5),  # noqa: UP045 - typing spelling on purpose
    (Optional[str], "None", None),  # noqa: UP045 - typing spelling on purpose
    (int | str, "3", 3),
    (int | str, "x", "x"),
    (list[int], "1,2,3", [1, 2, 3]),
    (list[int], "[1, 2, 3]", [1, 2, 3]),
    (list[int], "", []),
    (list[str], "a, b", ["a", "b"]),
    (list[str], "[a,b]", ["a", "b"]),
    (list[float], "[1, 2.5]", [1.0, 2.5]),
    (tuple[int, ...], "4,5", (4, 5)),
    (tuple[int, str], '[1, "x"]', (1, "x")),
    (tuple[int, str], "1,x", (1, "x")),
    (dict[str, int], '{"a": 1}', {"a": 1}),
    (Color, "BLUE", Color.BLUE),
    (Color, "blue", Color.BLUE),
    (Level, "2", Level.HIGH),
    (Level, "HIGH", Level.HIGH),
    (Literal["a", "b"], "b", "b"),
    (Literal[1, 2], "2", 2),
    (Callable[..., Any], "math:sqrt", math.sqrt),
    (Any, "[1, 2]", [1, 2]),
    (Any, "plain text", "plain text"),
    (Layer, '{"dim": 3}', Layer(dim=3)),
]


@pytest.mark.parametrize(("annotation", "text", "expected"), PARSED)
def test_override_text_is_parsed_by_annotation(
    annotation: object, text: str, expected: object
) -> None:
    value = _parse(annotation, text)
    assert value == expected
    assert type(value) is type(expected)


UNPARSED = [
    (int, "1.5", "expected int, found '1.5'"),
    (int, "ten", "expected int, found 'ten'"),
    (float, "fast", "expected float, found 'fast'"),
    (bool, "maybe", "expected bool (true/false/1/0/yes/no), found 'maybe'"),
    (int, "none", "expected int, found 'none'"),
    (Color, "green", "expected Color: one of RED ('red'), BLUE ('blue'), found 'green'"),
    (Literal["a", "b"], "c", "expected one of 'a', 'b', found 'c'"),
    (tuple[int, int], "1,2,3", "expected tuple[int, int] (2 items), found 3 items"),
    (dict[str, int], "a=1", "expected JSON for dict[str, int], found 'a=1'"),
    (Optional[int], "x", "expected int | None, found 'x'"),  # noqa: UP045 - typing spelling on purpose
]


@pytest.mark.parametrize(("annotation", "text", "message"), UNPARSED)
def test_override_text_rejected_with_path_expected_and_found(
    annotation: object, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(annotation, text)
    assert str(err.value).startswith("value")
    assert message in str(err.value)


def test_list_item_parse_error_names_the_item_path() -> None:
    with pytest.raises(ConfigError, match=r"^value\.1: expected int, found 'x'"):
        _parse(list[int], "1,x")


# ----------------------------------------------------------------------------- paths


def test_apply_overrides_sets_nested_values_and_leaves_the_original() -> None:
    base = Model()
    changed = base.apply_overrides(
        ["layers.1.dim=32", "optim.lr=0.1", "heads.main.bias=false", "pair.0.dropout=0.5"]
    )
    assert changed.layers[1].dim == 32
    assert changed.optim.lr == 0.1
    assert changed.heads["main"].bias is False
    assert changed.pair[0].dropout == 0.5
    assert base == Model()
    assert changed.layers[0] == base.layers[0]
    assert changed.layers[0] is not base.layers[0]


def test_later_overrides_see_earlier_ones() -> None:
    changed = Model().apply_overrides(['maybe={"dim": 2}', "maybe.dim=3"])
    assert changed.maybe == Layer(dim=3)


def test_override_adds_a_new_dict_entry() -> None:
    assert Model().apply_overrides(["limits.steps=10"]).limits == {"steps": 10}


def test_override_unknown_field_suggests_closest() -> None:
    with pytest.raises(ConfigError) as err:
        Model().apply_overrides(["layers.0.dimm=3"])
    text = str(err.value)
    assert text.startswith("layers.0.dimm: unknown field 'dimm' for Layer; did you mean 'dim'?")


def test_override_index_out_of_range() -> None:
    with pytest.raises(
        ConfigError, match=r"^layers\.5: expected an index below 2 \(length of the list\), found 5$"
    ):
        Model().apply_overrides(["layers.5.dim=3"])


def test_override_through_none_names_the_none_path() -> None:
    with pytest.raises(ConfigError, match=r"^maybe: is None; cannot set maybe\.dim below it"):
        Model().apply_overrides(["maybe.dim=3"])


def test_override_unknown_dict_key_in_the_middle() -> None:
    with pytest.raises(
        ConfigError, match=r"^heads\.mian: unknown key 'mian'; did you mean 'main'\?"
    ):
        Model().apply_overrides(["heads.mian.dim=3"])


def test_override_init_false_field_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^computed: field 'computed' of Model is init=False"):
        Model().apply_overrides(["computed=3"])


@pytest.mark.parametrize("text", ["layers.0.dim", "=3", "layers..dim=3"])
def test_malformed_override_is_rejected(text: str) -> None:
    with pytest.raises(ConfigError, match=r"override: expected 'dotted\.path=value'"):
        Model().apply_overrides([text])


def test_failed_override_leaves_the_config_untouched() -> None:
    base = Model()
    with pytest.raises(ConfigError):
        base.apply_overrides(["layers.0.dim=5", "layers.1.dim=oops"])
    assert base == Model()


def test_single_string_instead_of_list_is_rejected() -> None:
    with pytest.raises(ConfigError, match="expected a list of 'path=value' strings"):
        Model().apply_overrides("optim.lr=0.1")


# ----------------------------------------------------------------------------- CLI


def test_parse_cli_overrides_both_spellings() -> None:
    argv = ["--optim.lr=0.1", "--layers.0.dim", "32", "train.py", "--verbose"]
    assert parse_cli_overrides(argv) == (
        ["optim.lr=0.1", "layers.0.dim=32"],
        ["train.py", "--verbose"],
    )


def test_parse_cli_overrides_negative_number_value() -> None:
    assert parse_cli_overrides(["--optim.lr", "-1"]) == (["optim.lr=-1"], [])


def test_parse_cli_overrides_stops_at_double_dash() -> None:
    assert parse_cli_overrides(["--a=1", "--", "--b=2"]) == (["a=1"], ["--", "--b=2"])


def test_parse_cli_overrides_with_config_cls_leaves_other_options() -> None:
    argv = ["--help", "--optim.lr=0.5", "--seed", "3", "--layers.1.bias", "no"]
    overrides, rest = parse_cli_overrides(argv, Model)
    assert overrides == ["optim.lr=0.5", "layers.1.bias=no"]
    assert rest == ["--help", "--seed", "3"]
    config = Model().apply_overrides(overrides)
    assert config.optim.lr == 0.5 and config.layers[1].bias is False


def test_parse_cli_overrides_with_config_cls_requires_a_value() -> None:
    with pytest.raises(ConfigError, match=r"^optim\.lr: --optim\.lr: expected a value"):
        parse_cli_overrides(["--optim.lr"], Model)


# ----------------------------------------------------------------------------- files


def test_load_config_json_with_overrides(tmp_path: Path) -> None:
    expected = Model().apply_overrides(["layers.0.dim=4", "optim.name=sgd"])
    file = tmp_path / "model.json"
    file.write_text(json.dumps(expected.to_dict()))
    assert load_config(file, Model) == expected
    assert load_config(file, Model, ["optim.lr=0.5"]).optim.lr == 0.5


def test_load_config_toml(tmp_path: Path) -> None:
    file = tmp_path / "model.toml"
    file.write_text('[optim]\nlr = 0.25\nname = "sgd"\n\n[[layers]]\ndim = 16\n')
    loaded = load_config(file, Model)
    assert loaded == Model(layers=[Layer(dim=16)], optim=Optim(lr=0.25, name="sgd"))


def test_load_config_errors_name_file_and_path(tmp_path: Path) -> None:
    file = tmp_path / "bad.json"
    file.write_text('{"layers": [{"dim": "4"}]}')
    with pytest.raises(ConfigError) as err:
        load_config(file, Model)
    assert str(err.value) == f"{file}: layers.0.dim: expected int, found str '4'"
    assert err.value.path == "layers.0.dim"


def test_load_config_rejects_unknown_suffix(tmp_path: Path) -> None:
    file = tmp_path / "model.yaml"
    file.write_text("{}")
    with pytest.raises(
        ConfigError, match=r"expected a \.json or \.toml file, found suffix '\.yaml'"
    ):
        load_config(file, Model)


def test_load_config_invalid_json(tmp_path: Path) -> None:
    file = tmp_path / "broken.json"
    file.write_text("{")
    with pytest.raises(ConfigError, match=r"broken\.json: expected valid JSON, found: "):
        load_config(file, Model)


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.json: cannot read"):
        load_config(tmp_path / "missing.json", Model)

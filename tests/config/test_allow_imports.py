"""A config file is data, not code: ``allow_imports`` confines which modules callables come from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hyper_parallel.config import ConfigError, Configurable, load_config


class Job(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        init: Callable[..., object] | None = None
        hooks: list[Callable[..., object]] = field(default_factory=list)

    def __init__(self, *, config: Job.Config) -> None:
        self.config = config


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval"])
def test_from_dict_refuses_a_callable_outside_the_allowlist(ref: str) -> None:
    module = ref.split(":")[0]
    with pytest.raises(ConfigError, match=rf"refusing to import '{ref}': module '{module}'") as e:
        Job.Config.from_dict({"init": ref}, allow_imports=("math",))
    assert e.value.path == "init"


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval"])
def test_overrides_refuse_a_callable_outside_the_allowlist(ref: str) -> None:
    with pytest.raises(ConfigError, match="not on the allowlist") as e:
        Job.Config(hooks=[math.sqrt]).apply_overrides([f"hooks.0={ref}"], allow_imports=("math",))
    assert e.value.path == "hooks.0"
    with pytest.raises(ConfigError, match="not on the allowlist") as e:
        Job.Config().apply_overrides([f"init={ref}"], allow_imports=("math",))
    assert e.value.path == "init"


def test_allowlist_admits_its_modules_and_their_submodules() -> None:
    config = Job.Config.from_dict(
        {"init": "math:sqrt", "hooks": ["os.path:join"]}, allow_imports=("math", "os.path")
    )
    assert config.init is math.sqrt
    assert config.apply_overrides(["init=math:floor"], allow_imports=("math",)).init is math.floor
    with pytest.raises(ConfigError, match="'os'"):  # 'os.path' does not allow its parent
        Job.Config.from_dict({"init": "os:getcwd"}, allow_imports=("os.path",))


def test_without_an_allowlist_any_importable_callable_resolves() -> None:
    assert Job.Config.from_dict({"init": "os:getcwd"}).init is __import__("os").getcwd


def test_load_config_applies_the_allowlist_to_the_file_and_the_overrides(tmp_path: Path) -> None:
    file = tmp_path / "job.toml"
    file.write_text('init = "builtins:eval"\n')
    with pytest.raises(ConfigError, match="builtins"):
        load_config(file, Job.Config, allow_imports=("math",))
    file.write_text('init = "math:sqrt"\n')
    with pytest.raises(ConfigError, match="os"):
        load_config(file, Job.Config, ["init=os:system"], allow_imports=("math",))
    assert load_config(file, Job.Config, allow_imports=("math",)).init is math.sqrt

"""A config file is data, not code: ``allow_imports`` confines which modules callables come from."""

from __future__ import annotations

import json
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
        {"init": "math:sqrt", "hooks": ["json.decoder:JSONDecoder"]}, allow_imports=("math", "json")
    )
    assert config.init is math.sqrt
    assert config.hooks == [json.decoder.JSONDecoder]
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


def test_the_allowlist_checks_what_a_path_resolves_to_not_the_text_before_the_colon(
    tmp_path: Path,
) -> None:
    import posixpath

    allowed = ("logging", "os.path")
    # an attribute walk out of the allowed module: logging imports os, so logging.os.system
    walk = "logging:os.system"
    with pytest.raises(ConfigError, match="passes through module 'os'") as e:
        Job.Config.from_dict({"init": walk}, allow_imports=allowed)
    assert e.value.path == "init"
    # ... also as the function of a _partial_ (which would run a shell command when called)
    marker = tmp_path / "ran"
    partial = {"_partial_": walk, "args": [f"touch {marker}"]}
    with pytest.raises(ConfigError, match="passes through module 'os'"):
        Job.Config.from_dict({"hooks": [partial]}, allow_imports=allowed)
    with pytest.raises(ConfigError, match="passes through module 'os'"):
        Job.Config().apply_overrides([f"init={walk}"], allow_imports=allowed)
    assert not marker.exists()
    # a function an allowed module imported from elsewhere: refused by where it is defined
    with pytest.raises(ConfigError, match="defined in module 'genericpath'"):
        Job.Config.from_dict({"init": "os.path:exists"}, allow_imports=allowed)
    both = ("os.path", "posixpath")  # the module named and the one defining join
    assert Job.Config.from_dict({"init": "os.path:join"}, allow_imports=both).init is posixpath.join

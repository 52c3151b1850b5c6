"""get_platform(): entry-point discovery, env-var selection, caching and its errors."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint

import pytest
import torch

from hyper_parallel.platform import (
    ENTRY_POINT_GROUP,
    PLATFORM_ENV_VAR,
    Platform,
    PlatformNotFoundError,
    discovery,
    get_platform,
)
from hyper_parallel.platform_torch import TorchPlatform

# Static check (mypy --strict): TorchPlatform satisfies the Platform protocol.
_TORCH_PLATFORM: Platform = TorchPlatform()


class _OtherPlatform(TorchPlatform):
    name = "other"


class _FakeEntryPoint:
    """An entry point whose ``load()`` returns a given object, without a distribution."""

    def __init__(self, name: str, target: object) -> None:
        self.name = name
        self.value = f"fake:{name}"
        self.group = ENTRY_POINT_GROUP
        self._target = target

    def load(self) -> object:
        return self._target


@pytest.fixture(autouse=True)
def _fresh_platform_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(PLATFORM_ENV_VAR, raising=False)
    get_platform.cache_clear()
    yield
    get_platform.cache_clear()


def _install(monkeypatch: pytest.MonkeyPatch, *entry_points: object) -> None:
    def fake_entry_points(*, group: str) -> list[object]:
        assert group == ENTRY_POINT_GROUP
        return list(entry_points)

    monkeypatch.setattr(discovery, "entry_points", fake_entry_points)


def test_installed_torch_adapter_is_discovered_through_its_entry_point() -> None:
    installed = discovery.installed_platforms()
    assert installed["torch"].value == "hyper_parallel.platform_torch:TorchPlatform"
    platform = get_platform()
    assert isinstance(platform, TorchPlatform)
    assert platform.name == "torch"
    assert platform.Module is torch.nn.Module
    assert platform.Parameter is torch.nn.Parameter
    assert platform.rng_is_sequential(torch.device("cpu"))


def test_get_platform_is_cached_until_cache_clear() -> None:
    first = get_platform()
    assert get_platform() is first
    get_platform.cache_clear()
    assert get_platform() is not first


def test_env_var_picks_one_of_several_installed_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_ep = EntryPoint("torch", "hyper_parallel.platform_torch:TorchPlatform", ENTRY_POINT_GROUP)
    _install(monkeypatch, torch_ep, _FakeEntryPoint("other", _OtherPlatform))
    monkeypatch.setenv(PLATFORM_ENV_VAR, "other")
    assert get_platform().name == "other"
    get_platform.cache_clear()
    monkeypatch.setenv(PLATFORM_ENV_VAR, "torch")
    assert type(get_platform()) is TorchPlatform


def test_several_adapters_without_env_var_is_an_error_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _install(
        monkeypatch,
        _FakeEntryPoint("torch", TorchPlatform),
        _FakeEntryPoint("other", _OtherPlatform),
    )
    with pytest.raises(
        PlatformNotFoundError, match=r"several.*\('other', 'torch'\).*" + PLATFORM_ENV_VAR
    ):
        get_platform()


def test_unknown_env_var_name_lists_installed_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLATFORM_ENV_VAR, "jax")
    with pytest.raises(PlatformNotFoundError, match=r"HYPER_PARALLEL_PLATFORM='jax'.*\('torch',\)"):
        get_platform()


def test_no_adapter_installed_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch)
    with pytest.raises(PlatformNotFoundError, match="pip install hp-platform-torch"):
        get_platform()


def test_adapter_missing_protocol_members_is_rejected_with_their_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Incomplete:
        name = "incomplete"

    _install(monkeypatch, _FakeEntryPoint("incomplete", Incomplete))
    with pytest.raises(PlatformNotFoundError, match=r"'incomplete'.*missing members.*'all_gather'"):
        get_platform()


def test_adapter_that_fails_to_import_names_its_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken = EntryPoint("broken", "no_such_module_hp:Platform", ENTRY_POINT_GROUP)
    _install(monkeypatch, broken)
    with pytest.raises(PlatformNotFoundError, match=r"cannot load.*'broken'.*no_such_module_hp"):
        get_platform()


def test_platform_protocol_stays_small_and_torch_adapter_implements_all_of_it() -> None:
    members = discovery.protocol_members()
    assert len(members) <= 30
    assert isinstance(TorchPlatform(), Platform)
    for member in members:
        assert getattr(Platform, member, None) is not None or member in Platform.__annotations__
        assert hasattr(TorchPlatform(), member), member

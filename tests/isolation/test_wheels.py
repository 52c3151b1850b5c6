"""What each built wheel contains and declares: the contract of independent packages."""

from __future__ import annotations

import configparser
import importlib.metadata
from pathlib import Path

import pytest

from hp_workspace import (
    PACKAGES,
    ROOT,
    TEST_EXTRA,
    Built,
    read_version,
    wheel_entry_points,
    wheel_files,
    wheel_metadata,
    wheel_requirements,
)

NAMES = sorted(PACKAGES)


@pytest.mark.parametrize("name", NAMES)
def test_sdist_and_wheel_build_alone_with_uv_build_package(
    name: str, built: dict[str, Built]
) -> None:
    version = read_version(PACKAGES[name].pyproject)
    assert built[name].wheel.name == f"{PACKAGES[name].wheel_stem}-{version}-py3-none-any.whl"
    sdist = built[name].sdist
    assert sdist is not None and sdist.name == f"{PACKAGES[name].wheel_stem}-{version}.tar.gz"
    assert sdist.stat().st_size > 0


@pytest.mark.parametrize("name", NAMES)
def test_wheel_has_no_namespace_init(name: str, wheels: dict[str, Path]) -> None:
    files = wheel_files(wheels[name])
    assert "hyper_parallel/__init__.py" not in files, (
        f"{wheels[name].name} ships hyper_parallel/__init__.py; hyper_parallel must stay a "
        "PEP 420 namespace shared by the four packages"
    )


@pytest.mark.parametrize("name", NAMES)
def test_wheel_ships_py_typed_for_each_import_package(name: str, wheels: dict[str, Path]) -> None:
    files = set(wheel_files(wheels[name]))
    for import_name in PACKAGES[name].import_names:
        folder = import_name.replace(".", "/")
        assert f"{folder}/__init__.py" in files, f"{wheels[name].name}: no {folder}/__init__.py"
        assert f"{folder}/py.typed" in files, f"{wheels[name].name}: no {folder}/py.typed"


@pytest.mark.parametrize("name", NAMES)
def test_wheel_holds_only_its_own_import_packages(name: str, wheels: dict[str, Path]) -> None:
    own = tuple(n.replace(".", "/") + "/" for n in PACKAGES[name].import_names)
    foreign = [
        f for f in wheel_files(wheels[name]) if not f.startswith(own) and ".dist-info/" not in f
    ]
    assert foreign == [], f"{wheels[name].name} holds files of other packages: {foreign}"


@pytest.mark.parametrize("name", NAMES)
def test_wheel_version_matches_pyproject(name: str, wheels: dict[str, Path]) -> None:
    metadata = wheel_metadata(wheels[name])
    assert (metadata["Name"], metadata["Version"]) == (name, read_version(PACKAGES[name].pyproject))


@pytest.mark.parametrize("name", NAMES)
def test_inter_package_requirements_are_ranges_containing_current_versions(
    name: str, wheels: dict[str, Path]
) -> None:
    for requirement in wheel_requirements(wheels[name]):
        if requirement.name not in PACKAGES:
            continue
        operators = {spec.operator for spec in requirement.specifier}
        where = f"{name} requires {requirement}"
        assert not operators & {"==", "==="}, f"{where}: pin, expected a range like >=0.1,<0.2"
        assert ">=" in operators and "<" in operators, f"{where}: expected >=LOW,<HIGH"
        current = read_version(PACKAGES[requirement.name].pyproject)
        assert requirement.specifier.contains(current, prereleases=True), (
            f"{where}, which excludes the workspace's {requirement.name} {current}"
        )


def test_hp_config_wheel_declares_no_dependencies_outside_its_test_extra(
    wheels: dict[str, Path],
) -> None:
    requirements = wheel_requirements(wheels["hp-config"])
    for_users = [
        str(r) for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})
    ]
    assert for_users == []
    assert all(
        r.marker is not None and r.marker.evaluate({"extra": TEST_EXTRA}) for r in requirements
    )
    assert "torch" not in {r.name for r in requirements}


def test_platform_torch_lists_torch_npu_only_under_npu_extra(wheels: dict[str, Path]) -> None:
    wheel = wheels["hp-platform-torch"]
    assert "npu" in (wheel_metadata(wheel).get_all("Provides-Extra") or [])
    npu = [r for r in wheel_requirements(wheel) if r.name == "torch-npu"]
    assert npu, "hp-platform-torch: expected torch-npu under the npu extra, found none"
    for requirement in npu:
        assert requirement.marker is not None, f"unconditional requirement {requirement}"
        assert requirement.marker.evaluate({"extra": "npu"}), str(requirement)
        for extra in ("", "torch", "cuda"):
            assert not requirement.marker.evaluate({"extra": extra}), str(requirement)
    torch = [r for r in wheel_requirements(wheel) if r.name == "torch"]
    assert any(r.marker is None for r in torch), "hp-platform-torch: torch must be required"


def test_platform_torch_registers_its_platform_entry_point(wheels: dict[str, Path]) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel_entry_points(wheels["hp-platform-torch"]))
    assert entry_points.has_option("hyper_parallel.platforms", "torch")
    target = entry_points.get("hyper_parallel.platforms", "torch")
    assert target.startswith("hyper_parallel.platform_torch"), target


def test_workspace_sources_have_no_namespace_init() -> None:
    offenders = sorted(ROOT.glob("packages/*/src/hyper_parallel/__init__.py"))
    assert offenders == []


def test_default_environment_has_no_torch_npu() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("torch-npu")

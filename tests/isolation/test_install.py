"""Each package installs from its wheel into a fresh venv, with no more than it declares.

These create virtual environments with uv; torch comes hard-linked from uv's cache at the
version uv.lock pins, so each full-stack venv takes seconds, not a 4 GB download.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hp_workspace import (
    PACKAGES,
    TEST_EXTRA,
    create_venv,
    install_from_wheels,
    installed,
    pip_install,
    read_version,
    run,
    run_package_tests,
)

pytestmark = pytest.mark.isolation

WORKSPACE = set(PACKAGES)


def python_check(python: Path, code: str) -> str:
    """Run ``code`` with ``python`` (outside the workspace's venv); return its stdout."""
    return run([python, "-c", code])


@pytest.fixture(scope="module")
def config_alone(
    tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]
) -> tuple[Path, dict[str, str]]:
    """A venv with only hp-config's wheel; also what it held right after that install."""
    python = create_venv(tmp_path_factory.mktemp("config-venv") / "venv")
    pip_install(python, [wheels["hp-config"]], no_deps=True)
    # Installing again with dependencies, offline, must find nothing more to add.
    pip_install(python, [wheels["hp-config"]], no_index=True)
    return python, installed(python)


def test_hp_config_installs_alone_with_zero_dependencies(
    config_alone: tuple[Path, dict[str, str]],
) -> None:
    _, versions = config_alone
    assert versions == {"hp-config": read_version(PACKAGES["hp-config"].pyproject)}


def test_hp_config_imports_without_torch(config_alone: tuple[Path, dict[str, str]]) -> None:
    python, _ = config_alone
    where = python_check(
        python,
        "import importlib.util, sys\n"
        "import hyper_parallel.config as config\n"
        "assert 'torch' not in sys.modules, 'importing hyper_parallel.config imported torch'\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
        "print(config.__file__)",
    )
    assert str(python.parent.parent) in where, f"imported from {where}, not from the venv"


def test_hp_config_tests_pass_from_its_wheel_with_its_test_extra(
    config_alone: tuple[Path, dict[str, str]], wheels: dict[str, Path], constraints: Path
) -> None:
    python, _ = config_alone
    install_from_wheels(
        python, PACKAGES["hp-config"], wheels, constraints=constraints, extras=(TEST_EXTRA,)
    )
    assert "torch" not in installed(python)
    run_package_tests(python, PACKAGES["hp-config"])


def test_hp_dtensor_installs_without_config_or_dmodule(
    tmp_path: Path, wheels: dict[str, Path], constraints: Path
) -> None:
    python = create_venv(tmp_path / "venv")
    install_from_wheels(python, PACKAGES["hp-dtensor"], wheels, constraints=constraints)
    versions = installed(python)
    assert versions.keys() & WORKSPACE == {"hp-dtensor", "hp-platform-torch"}
    assert "torch" in versions and "torch-npu" not in versions
    python_check(python, "import hyper_parallel.dtensor, hyper_parallel.platform")


@pytest.fixture(scope="module")
def full_stack(
    tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path], constraints: Path
) -> Path:
    """A venv with ``hp-dmodule[torch]`` installed from the four wheels; its python."""
    python = create_venv(tmp_path_factory.mktemp("full-stack") / "venv")
    install_from_wheels(
        python, PACKAGES["hp-dmodule"], wheels, constraints=constraints, extras=("torch",)
    )
    return python


def test_full_stack_installs_from_the_four_wheels_and_imports(full_stack: Path) -> None:
    versions = installed(full_stack)
    # hp-train sits above hp-dmodule: the full stack of the library never pulls the trainer
    stack = [name for name in WORKSPACE if name != "hp-train"]
    assert {name: versions.get(name) for name in stack} == {
        name: read_version(PACKAGES[name].pyproject) for name in stack
    }
    assert "hp-train" not in versions
    assert "torch" in versions and "torch-npu" not in versions
    imported = python_check(
        full_stack,
        "import hyper_parallel.config, hyper_parallel.platform, hyper_parallel.dtensor\n"
        "import hyper_parallel.dmodule, hyper_parallel.platform_torch\n"
        "for m in (hyper_parallel.config, hyper_parallel.platform, hyper_parallel.dtensor,\n"
        "          hyper_parallel.dmodule, hyper_parallel.platform_torch):\n"
        "    print(m.__file__)\n",
    )
    venv = str(full_stack.parent.parent)
    assert all(line.startswith(venv) for line in imported.split()), imported


def test_full_stack_get_platform_finds_torch(full_stack: Path) -> None:
    import hyper_parallel.platform

    if not hasattr(hyper_parallel.platform, "get_platform"):
        pytest.skip("hyper_parallel.platform.get_platform is not written yet")
    name = python_check(
        full_stack, "from hyper_parallel.platform import get_platform; print(get_platform().name)"
    )
    assert name.strip() == "torch"

"""Device specifics of the torch adapter: backends, devices, RNG, lazy torch_npu (faked)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

import pytest
import torch
from tests._harness import run_on_ranks

from hyper_parallel.platform_torch import TorchPlatform, devices

PLATFORM = TorchPlatform()


def test_backend_for_maps_each_device_type() -> None:
    assert [devices.backend_for(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]


def test_unknown_device_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'tpu'.*\('cpu', 'cuda', 'npu'\)"):
        PLATFORM.ensure_device_type("tpu")
    with pytest.raises(ValueError, match="'xpu'"):
        PLATFORM.device_for("xpu")


def test_device_for_cpu() -> None:
    assert PLATFORM.device_for("cpu") == torch.device("cpu")


def test_cuda_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(devices.DeviceUnavailableError, match=r"'cuda'.*is_available.*False"):
        PLATFORM.ensure_device_type("cuda")


def test_device_for_cuda_uses_local_rank_modulo_device_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert PLATFORM.device_for("cuda") == torch.device("cuda", 2)


def test_only_the_cpu_generator_is_sequential() -> None:
    # CPU: filling 2N elements equals filling N then N from the same seed.
    torch.manual_seed(5)
    whole = torch.empty(64).normal_()
    torch.manual_seed(5)
    pieces = torch.cat([torch.empty(32).normal_(), torch.empty(32).normal_()])
    assert torch.equal(whole, pieces)
    assert PLATFORM.rng_is_sequential(torch.device("cpu"))
    assert not PLATFORM.rng_is_sequential(torch.device("cuda", 0))


# -- NPU, with fakes: a real torch_npu is never imported ---------------------------------
def test_npu_without_torch_npu_says_to_install_the_npu_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(devices.DeviceUnavailableError) as caught:
        PLATFORM.ensure_device_type("npu")
    message = str(caught.value)
    assert "not installed" in message
    assert 'pip install "hp-platform-torch[npu]"' in message
    assert "CANN" in message


class _BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` but fails to load it, as a torch_npu without CANN does."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch_npu":
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        raise OSError("libhccl.so: cannot open shared object file: No such file or directory")


def test_npu_with_torch_npu_failing_to_load_blames_cann(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpuFinder(), *sys.meta_path])
    with pytest.raises(devices.DeviceUnavailableError) as caught:
        PLATFORM.device_for("npu")
    message = str(caught.value)
    assert "failed to load" in message and "libhccl.so" in message
    assert "CANN" in message and 'pip install "hp-platform-torch[npu]"' in message
    assert "torch_npu" not in sys.modules


def _npu_with_fake_torch_npu(local_rank: str) -> dict[str, object]:
    """In a rank process: install a fake torch_npu (it renames torch's private backend)."""
    calls: list[tuple[str, object]] = []
    npu = types.SimpleNamespace(
        device_count=lambda: 4,
        set_device=lambda device: calls.append(("set_device", str(device))),
    )
    fake = types.ModuleType("torch_npu")
    fake.npu = npu  # type: ignore[attr-defined]
    # What the real torch_npu does on import (done here only inside a rank process).
    torch.utils.rename_privateuse1_backend("npu")  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = fake
    import os

    os.environ["LOCAL_RANK"] = local_rank
    platform = TorchPlatform()
    platform.ensure_device_type("npu")
    device = platform.device_for("npu")
    current = devices.set_current_device("npu")
    return {"device": str(device), "current": str(current), "calls": calls}


def test_npu_with_fake_torch_npu_picks_the_device_from_torch_npu() -> None:
    (result,) = run_on_ranks(_npu_with_fake_torch_npu, 1, "6")
    assert result["device"] == "npu:2"  # LOCAL_RANK 6 % 4 devices
    assert result["current"] == "npu:2"
    assert result["calls"] == [("set_device", "npu:2")]

"""Device specifics: backend per device type, this process's device, RNG kind, lazy torch_npu."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "DeviceUnavailableError",
    "backend_for",
    "device_for",
    "ensure_device_type",
    "rng_is_sequential",
    "set_current_device",
]

#: Communication backend of each supported device type.
BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

_NPU_INSTALL_HINT = (
    'install the npu extra, `pip install "hp-platform-torch[npu]"`, on a machine with the '
    "Ascend CANN toolkit installed and its set_env.sh sourced"
)


class DeviceUnavailableError(RuntimeError):
    """The requested device type cannot be used in this environment."""


def backend_for(device_type: str) -> str:
    """Communication backend for ``device_type``.

    Example::

        >>> backend_for("cpu"), backend_for("cuda"), backend_for("npu")
        ('gloo', 'nccl', 'hccl')
    """
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"unsupported device_type {device_type!r}; supported device types are {tuple(BACKENDS)}"
        ) from None


def _import_torch_npu() -> ModuleType:
    """Import torch_npu on first use, turning every way it can fail into one clear error."""
    try:
        return importlib.import_module("torch_npu")
    except ModuleNotFoundError as error:
        if error.name != "torch_npu":
            raise DeviceUnavailableError(
                f"torch_npu is installed but failed to import ({error}); {_NPU_INSTALL_HINT}"
            ) from error
        raise DeviceUnavailableError(
            f"device_type 'npu' needs torch_npu, which is not installed; {_NPU_INSTALL_HINT}"
        ) from error
    except Exception as error:
        raise DeviceUnavailableError(
            f"torch_npu is installed but failed to load ({type(error).__name__}: {error}); "
            f"this usually means the Ascend CANN toolkit is missing; {_NPU_INSTALL_HINT}"
        ) from error


def ensure_device_type(device_type: str) -> None:
    """Raise a clear error unless ``device_type`` can be used in this process.

    For ``"npu"`` this imports torch_npu (which registers the ``npu`` device and
    the ``hccl`` backend with torch).

    Example::

        >>> ensure_device_type("cpu")
    """
    backend_for(device_type)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device_type 'cuda' requested but no CUDA device is usable "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
            f"torch.cuda.is_available() is False); use device_type 'cpu'"
        )
    if device_type == "npu":
        _import_torch_npu()


def _local_index(device_type: str, count: int) -> int:
    """This process's accelerator index: ``LOCAL_RANK`` modulo the visible device count."""
    if count < 1:
        raise DeviceUnavailableError(f"device_type {device_type!r}: no device is visible")
    return int(os.environ.get("LOCAL_RANK", "0")) % count


def device_for(device_type: str) -> torch.device:
    """This process's device of ``device_type`` (accelerators: ``LOCAL_RANK % count``).

    Example::

        >>> device_for("cpu")
        device(type='cpu')
    """
    ensure_device_type(device_type)
    if device_type == "cuda":
        return torch.device("cuda", _local_index("cuda", torch.cuda.device_count()))
    if device_type == "npu":
        npu = _import_torch_npu().npu
        return torch.device("npu", _local_index("npu", npu.device_count()))
    return torch.device("cpu")


def set_current_device(device_type: str) -> torch.device:
    """Make this process's device of ``device_type`` the current one, and return it.

    Example::

        >>> set_current_device("cpu")
        device(type='cpu')
    """
    device = device_for(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        _import_torch_npu().npu.set_device(device)
    return device


def rng_is_sequential(device: torch.device) -> bool:
    """True when ``device``'s default generator is one stream consumed in element order.

    torch's CPU generator is a single Mersenne Twister; CUDA and NPU generators are
    counter based (Philox), their draws mapped to elements by the kernel's launch grid.

    Example::

        >>> rng_is_sequential(torch.device("cpu")), rng_is_sequential(torch.device("cuda"))
        (True, False)
    """
    return device.type == "cpu"

"""The PyTorch platform adapter for hyper-parallel: CPU (gloo), CUDA (nccl), Ascend NPU (hccl).

``TorchPlatform`` implements ``hyper_parallel.platform.Platform`` and is registered
under the entry point ``torch`` of the group ``hyper_parallel.platforms``.
Submodules: ``comm`` (out-of-place collectives), ``devices`` (device specifics),
``launch`` (``run_distributed``).

Example::

    >>> from hyper_parallel.platform_torch import TorchPlatform
    >>> TorchPlatform().device_for("cpu")
    device(type='cpu')
"""

from hyper_parallel.platform_torch.platform import TorchPlatform

__all__ = ["TorchPlatform"]

"""The policies ``fully_shard`` takes: mixed precision and offloading, as torch's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision of one ``fully_shard`` group, as torch's ``MixedPrecisionPolicy``.

    ``param_dtype``: dtype of the unsharded parameters (the all-gather runs in it);
    ``reduce_dtype``: dtype of the gradient reduction (default: ``param_dtype``);
    ``output_dtype``: dtype forward outputs are cast to; ``cast_forward_inputs``: cast
    floating-point forward inputs to ``param_dtype``. The sharded parameters and their
    gradients keep the original dtype.

    Example::

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mp_policy=mp)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (the default), as torch's ``OffloadPolicy``.

    Example::

        fully_shard(model, offload_policy=OffloadPolicy())
    """


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on the CPU; unshards copy them to the device.

    ``pin_memory`` pins the CPU shards when the device is an accelerator (as torch's).

    Example::

        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    """

    pin_memory: bool = True

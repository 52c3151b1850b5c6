"""Mixed precision of a job: FSDP's ``MixedPrecisionPolicy`` or ``torch.autocast``'s dtype."""

from __future__ import annotations

import torch

from hyper_parallel.dtensor.fsdp import MixedPrecisionPolicy
from hyper_parallel.train.config import JobConfig

__all__ = ["DTYPES", "autocast_dtype", "mixed_precision_policy"]

#: ``training.param_dtype`` / ``reduce_dtype`` names and the dtypes they stand for
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixed_precision_policy(job: JobConfig) -> MixedPrecisionPolicy | None:
    """FSDP's policy for ``training.param_dtype`` / ``reduce_dtype`` (``None``: no FSDP or float32).

    As TorchTitan: bfloat16 compute copies of the float32 weights, gradients reduced in
    ``reduce_dtype``; the weights, their gradients and AdamW's states stay float32.

    Example::

        >>> mixed_precision_policy(JobConfig().apply_overrides(
        ...     ["training.param_dtype=bfloat16", "parallelism.dp_shard=2"])).param_dtype
        torch.bfloat16
    """
    training, par = job.training, job.parallelism
    if par.dp_shard * par.cp == 1 or training.param_dtype == training.reduce_dtype == "float32":
        return None
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[training.param_dtype], reduce_dtype=DTYPES[training.reduce_dtype]
    )


def autocast_dtype(job: JobConfig) -> torch.dtype | None:
    """The dtype the forward runs in under ``torch.autocast`` (``None``: float32 or FSDP's policy).

    Example::

        >>> autocast_dtype(JobConfig().apply_overrides(["training.param_dtype=bfloat16"]))
        torch.bfloat16
    """
    dtype = job.training.param_dtype
    if dtype == "float32" or mixed_precision_policy(job) is not None:
        return None
    return DTYPES[dtype]

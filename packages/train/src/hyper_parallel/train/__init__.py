"""hp-train: the training job of hyper-parallel (``hp-train --config job.toml``).

Example::

    >>> from hyper_parallel.train import JobConfig
    >>> JobConfig().apply_overrides(["training.steps=10"]).training.steps
    10
"""

from hyper_parallel.train.config import (
    DEFAULT_ALLOWED_IMPORTS,
    JobConfig,
    batch_layout,
    check_job,
    load_job,
    to_toml,
)

__all__ = [
    "DEFAULT_ALLOWED_IMPORTS",
    "JobConfig",
    "batch_layout",
    "check_job",
    "load_job",
    "to_toml",
]

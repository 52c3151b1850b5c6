"""The learning-rate schedule: linear warmup, then cosine, linear or WSD decay to a minimum."""

from __future__ import annotations

import math

from hyper_parallel.train.config import LRSchedulerConfig

__all__ = ["lr_at"]


def lr_at(step: int, base_lr: float, config: LRSchedulerConfig) -> float:
    """The rate optimizer step ``step`` (counted from 1) uses.

    Warmup rises linearly to ``base_lr`` over ``warmup_steps``; then ``decay_steps`` decay
    to ``min_lr_ratio * base_lr`` (cosine, linear, or WSD: stable, then a linear decay over
    the last ``wsd_decay_ratio`` of them), which stays after. Without ``decay_steps`` the
    rate is ``base_lr`` after warmup. It never depends on the run's length.

    Example::

        >>> cfg = LRSchedulerConfig(warmup_steps=2, decay_steps=4, decay="linear")
        >>> [lr_at(s, 1.0, cfg) for s in range(1, 8)]
        [0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    warmup = config.warmup_steps
    if step <= warmup:
        return base_lr * step / warmup
    if config.decay_steps is None:
        return base_lr
    floor = config.min_lr_ratio * base_lr
    progress = min(1.0, (step - warmup) / config.decay_steps)
    if config.decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif config.decay == "linear":
        factor = 1.0 - progress
    else:  # wsd: stable, then linear over the last wsd_decay_ratio of decay_steps
        stable = 1.0 - config.wsd_decay_ratio
        factor = (
            1.0 if progress <= stable else (1.0 - progress) / max(config.wsd_decay_ratio, 1e-12)
        )
    return floor + (base_lr - floor) * factor

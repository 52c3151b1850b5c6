"""The loss-parallel mode: a process-wide switch read by the loss and softmax kernels.

A leaf (it imports nothing of the package): ``parallel.loss_parallel()`` sets it, the
rules of ``_ops/losses.py`` and ``_ops/reductions.py`` and the specials of
``_ops/loss_specials.py`` read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["loss_parallel_active", "loss_parallel_mode"]

# Process-wide, like torch's: autograd may run the backward on another thread, where a
# ContextVar set by the caller would not be seen.
_loss_parallel_depth = [0]


@contextmanager
def loss_parallel_mode() -> Iterator[None]:
    """Switch the class-sharded loss kernels to torch's loss-parallel behaviour while active.

    Example::

        with loss_parallel_mode():
            loss = F.cross_entropy(logits, target)   # logits class-sharded
    """
    _loss_parallel_depth[0] += 1
    try:
        yield
    finally:
        _loss_parallel_depth[0] -= 1


def loss_parallel_active() -> bool:
    """Whether :func:`loss_parallel_mode` is active (read by the kernels at run time).

    Example::

        with loss_parallel_mode():
            assert loss_parallel_active()
    """
    return _loss_parallel_depth[0] > 0

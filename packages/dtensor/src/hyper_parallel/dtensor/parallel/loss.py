"""``loss_parallel()``: cross-entropy on class-sharded logits, as torch's loss parallel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hyper_parallel.dtensor._loss_parallel import loss_parallel_mode

__all__ = ["loss_parallel"]


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute ``F.cross_entropy`` on logits sharded along the class dim, never gathering them.

    As ``torch.distributed.tensor.parallel.loss_parallel``: inside the context the
    input of ``cross_entropy`` / ``nll_loss`` / ``log_softmax`` must be a DTensor
    sharded on its class dim on exactly one mesh axis (``ValueError`` otherwise):
    ``(N, C)``, ``(C,)`` or ``(N, C, d...)`` logits;
    the target may be a plain tensor (taken as replicated) or a DTensor; the loss
    comes back replicated over that axis. The forward costs three all-reduces of
    ``(tokens,)``-sized values or less (row max, sum of exponentials, the loss) and
    the backward none; ``backward()`` must run inside the context too. It uses the
    same sharding rules as outside the context (which also never gather the
    logits but return a Partial loss and all-reduce once in the backward); see the
    hp-dtensor README for the differences from torch.

    Example::

        logits = model(tokens)   # a DTensor, Shard(-1) over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
    """
    with loss_parallel_mode():
        yield

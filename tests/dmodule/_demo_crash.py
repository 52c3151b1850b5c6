"""The demo with rank 1 raising at step 2: a test-only fault, injected from outside the demo.

``python -m tests.dmodule._demo_crash <demo args>`` (from the repository root) runs the
demo's ``main`` with each rank's training wrapped: an optimizer step hook, registered
in the rank process only, raises after the chosen rank's step ``CRASH_STEP - 1``, i.e.
when that rank is about to run step ``CRASH_STEP``, while the other ranks wait in a collective.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from hyper_parallel.dmodule import demo
from hyper_parallel.platform import get_platform

CRASH_RANK = 1
CRASH_STEP = 2


def crashing_train_rank(options: Any) -> Any:
    """``demo.train_rank``, except that rank ``CRASH_RANK`` raises once it starts step ``CRASH_STEP``."""
    rank = get_platform().get_rank()
    steps_done = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps_done[0] += 1
        if rank == CRASH_RANK and steps_done[0] == CRASH_STEP - 1:
            raise RuntimeError(f"injected crash on rank {rank} at step {CRASH_STEP}")

    handle = register_optimizer_step_post_hook(after_step)
    try:
        return demo.train_rank(options)
    finally:
        handle.remove()


if __name__ == "__main__":
    # Imported by its module name, so that the rank processes unpickle it from there.
    from tests.dmodule._demo_crash import crashing_train_rank as wrapped

    demo.train_rank = wrapped  # this process only: the demo's main launches it
    sys.exit(demo.main(sys.argv[1:]))

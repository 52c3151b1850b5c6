"""The demo with rank 1 stalling before step 2: a test-only fault, injected from outside the demo.

``python -m tests.dmodule._demo_stall <demo args>`` (from the repository root, directly or
under torchrun) runs the demo's ``main`` with each rank's training wrapped: an optimizer
step hook, registered in the rank process only, makes rank ``STALL_RANK`` sleep after its
step ``STALL_STEP - 1`` while the other ranks go on into step ``STALL_STEP``'s collectives.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from hyper_parallel.dmodule import demo
from hyper_parallel.platform import get_platform

STALL_RANK = 1
STALL_STEP = 2
# When set, the stalling rank writes the wall-clock time it started stalling to this file
# (a test checks that the stall began well within the demo's timeout).
MARKER_ENV = "HP_DEMO_STALL_MARKER"
# Taken when this module is imported, before __main__ below swaps demo.train_rank (under
# torchrun the swap happens in the rank process itself).
_TRAIN_RANK = demo.train_rank


def stalling_train_rank(options: Any) -> Any:
    """``demo.train_rank``, except that rank ``STALL_RANK`` never starts step ``STALL_STEP``."""
    rank = get_platform().get_rank()
    steps_done = [0]

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps_done[0] += 1
        if rank == STALL_RANK and steps_done[0] == STALL_STEP - 1:
            marker = os.environ.get(MARKER_ENV)
            if marker:
                Path(marker).write_text(repr(time.time()))
            time.sleep(3600)

    handle = register_optimizer_step_post_hook(after_step)
    try:
        return _TRAIN_RANK(options)
    finally:
        handle.remove()


if __name__ == "__main__":
    # Imported by its module name, so that the rank processes unpickle it from there.
    from tests.dmodule._demo_stall import stalling_train_rank as wrapped

    demo.train_rank = wrapped  # this process only: the demo's main launches it
    sys.exit(demo.main(sys.argv[1:]))

"""The demo as one torchrun worker, for the multi-node tests: ``python -m tests.dmodule._reliability_node``.

Each worker writes ``rank<RANK>.pid`` (its pid and its agent's) into ``HP_TEST_PID_DIR``;
with ``HP_TEST_STEP_S`` each optimizer step also touches ``rank<RANK>.stepped`` and then
sleeps that long, so a test can kill a "node" while training is under way.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from hyper_parallel.dmodule import demo


def main() -> int:
    """Record this worker's pids, slow its steps if asked, run the demo."""
    pid_dir = Path(os.environ["HP_TEST_PID_DIR"])
    rank = os.environ["RANK"]
    Path(pid_dir, f"rank{rank}.pid").write_text(f"{os.getpid()} {os.getppid()}")
    step_s = float(os.environ.get("HP_TEST_STEP_S", "0"))
    if step_s > 0:

        def slow_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            Path(pid_dir, f"rank{rank}.stepped").touch()
            time.sleep(step_s)

        register_optimizer_step_post_hook(slow_step)
    return demo.main()


if __name__ == "__main__":
    sys.exit(main())

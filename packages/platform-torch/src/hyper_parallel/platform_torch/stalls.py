"""Stalled ranks: each rank's Python stack (faulthandler), and which ranks did not arrive.

A rank that waits inside ``torch.distributed`` (a collective, a barrier, the rendezvous)
has *arrived*; the ranks that are elsewhere -- or have returned -- are the ones the others
wait for. :func:`run_distributed` asks its ranks for their stacks with ``SIGUSR1`` when it
times out; under an external launcher (torchrun) :func:`stall_watchdog` does the same
from inside each rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

__all__ = [
    "STACK_SIGNAL",
    "RankStack",
    "describe_stall",
    "parse_stack",
    "register_stack_dump",
    "stack_file",
    "stall_watchdog",
]

#: The signal a rank answers with its Python stack (every thread) once registered.
STACK_SIGNAL = signal.SIGUSR1

# Frames of these files mean "inside torch.distributed": the rank has arrived and waits.
_DISTRIBUTED = re.compile(
    r"[/\\]torch[/\\]distributed[/\\]|"
    r"[/\\]platform_torch[/\\](comm|_comm_errors|_comm_groups|platform|collectives)\.py$"
)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# The frame every rank's body runs under (run_distributed's rank entry point).
_ENTRY_FUNCS = ("_run_rank",)


@dataclass(frozen=True)
class RankStack:
    """One rank's main-thread stack, most recent call first, and where it stands.

    ``waiting_in``: the innermost ``torch.distributed`` function it waits in (None: it
    is not inside torch.distributed, i.e. it has not arrived); ``at``: ``file:line in
    function`` of the code it runs (for a waiting rank, the call into torch.distributed).
    """

    text: str
    waiting_in: str | None
    at: str


def register_stack_dump(file: IO[str]) -> None:
    """Make this process write every thread's Python stack to ``file`` on :data:`STACK_SIGNAL`.

    faulthandler's handler runs in C, so it answers even while the main thread is blocked
    inside a collective.

    Example::

        >>> import tempfile
        >>> register_stack_dump(tempfile.TemporaryFile("w+"))  # doctest: +SKIP
    """
    faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)


def parse_stack(text: str, main_ident: int | None = None) -> RankStack:
    """Where a faulthandler dump's main thread stands (see :class:`RankStack`).

    The main thread is the one with id ``main_ident`` when given, else the one running the
    rank's body (``_run_rank``), else the first listed as ``Current thread``, else the first.

    Example::

        >>> dump = ('Current thread 0x1 (most recent call first):\\n'
        ...         '  File "/x/torch/distributed/distributed_c10d.py", line 9 in all_reduce\\n'
        ...         '  File "/w/train.py", line 3 in step\\n')
        >>> parse_stack(dump).waiting_in, parse_stack(dump).at
        ('all_reduce', '/w/train.py:3 in step')
    """
    threads: list[list[tuple[str, str, str]]] = []
    current = -1
    wanted = -1
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
            if line.startswith("Current thread ") and current < 0:
                current = len(threads) - 1
            if main_ident is not None and f"0x{main_ident:016x}" in line:
                wanted = len(threads) - 1
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1].append((match["file"], match["line"], match["func"]))
    if not threads:
        return RankStack(text, None, "unknown (no stack)")
    main = (
        threads[wanted]
        if wanted >= 0
        else next(
            (t for t in threads if any(f[2] in _ENTRY_FUNCS for f in t)),
            threads[current if current >= 0 else 0],
        )
    )
    for index, (file, _, func) in enumerate(main):
        if _DISTRIBUTED.search(file):
            innermost = func
            callers = [f for f in main[index:] if not _DISTRIBUTED.search(f[0])]
            at = _where(callers[0]) if callers else _where(main[index])
            return RankStack(text, innermost, at)
    return RankStack(text, None, _where(main[0]) if main else "unknown (empty stack)")


def _where(frame: tuple[str, str, str]) -> str:
    return f"{frame[0]}:{frame[1]} in {frame[2]}"


def describe_stall(
    stacks: Mapping[int, RankStack], returned: Sequence[int] = ()
) -> tuple[list[int], list[str]]:
    """``(ranks that did not arrive, summary lines)`` for the stacks of the unfinished ranks.

    ``returned``: ranks that had already finished (they did not arrive either, when the
    others wait in a collective).

    Example::

        >>> waiting = RankStack("", "all_reduce", "t.py:3 in step")
        >>> busy = RankStack("", None, "t.py:9 in load")
        >>> describe_stall({0: waiting, 1: busy})[0]
        [1]
    """
    waiting = sorted(r for r, s in stacks.items() if s.waiting_in is not None)
    busy = sorted(r for r, s in stacks.items() if s.waiting_in is None)
    not_arrived = busy + ([] if busy or not waiting else sorted(returned))
    lines: list[str] = []
    if waiting and not_arrived:
        lines.append(
            f"ranks {not_arrived} did not arrive at the collective that ranks {waiting} wait in"
        )
    for rank in waiting:
        stack = stacks[rank]
        lines.append(f"rank {rank} waits in torch.distributed {stack.waiting_in} ({stack.at})")
    for rank in busy:
        lines.append(f"rank {rank} did not arrive at a collective: it is at {stacks[rank].at}")
    if waiting and not busy and returned:
        lines.append(f"ranks {sorted(returned)} had returned without that collective")
    elif waiting and not busy:
        lines.append("every unfinished rank waits in torch.distributed (mismatched collectives?)")
    return not_arrived, lines


@contextlib.contextmanager
def stall_watchdog(timeout_s: float, *, exit_code: int = 1) -> Iterator[None]:
    """Under an external launcher (torchrun): end the run if the block takes over ``timeout_s``.

    Then every rank prints, to stderr, whether it waits in a collective or did not arrive,
    with its Python stack; rank 0 also names the ranks that did not arrive (they meet in
    the launcher's rendezvous store); and the process exits with ``exit_code``, so the
    launcher stops the others at once instead of letting them wait for the process-group
    timeout. Give the process group a longer timeout than ``timeout_s``.

    Example::

        with stall_watchdog(60.0):
            train(model)
    """
    if timeout_s <= 0:
        raise ValueError(f"stall_watchdog: timeout_s must be > 0, got {timeout_s}")
    done = threading.Event()
    main_ident = threading.main_thread().ident
    thread = threading.Thread(
        target=_watch, args=(done, timeout_s, exit_code, main_ident), name="stall-watchdog"
    )
    thread.daemon = True
    thread.start()
    try:
        yield
    finally:
        done.set()


def _watch(done: threading.Event, timeout_s: float, exit_code: int, main_ident: int | None) -> None:
    if done.wait(timeout_s):
        return
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        text = dump.read()
    stack = parse_stack(text, main_ident)
    status = (
        f"waits in torch.distributed {stack.waiting_in} ({stack.at})"
        if stack.waiting_in is not None
        else f"did not arrive at a collective: it is at {stack.at}"
    )
    print(
        f"[rank {rank}] stall watchdog: no end after {timeout_s:g} s; rank {rank} {status}\n"
        f"[rank {rank}] Python stack (most recent call first):\n{text.rstrip()}",
        file=sys.stderr,
        flush=True,
    )
    summary = _share_status(rank, world, stack)
    if summary:
        print(f"[rank {rank}] stall watchdog: {summary}", file=sys.stderr, flush=True)
    os._exit(exit_code)


def _share_status(rank: int, world: int, stack: RankStack) -> str:
    """Publish this rank's status in the rendezvous store; rank 0 returns who did not arrive."""
    try:
        import torch.distributed as dist

        store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=5),
        )
        store.set(f"hp_stall/{rank}", "1" if stack.waiting_in is not None else "0")
        if rank != 0:
            time.sleep(2.0)  # let rank 0 read the statuses before this process ends
            return ""
        arrived: dict[int, bool] = {}
        deadline = time.monotonic() + 3.0
        while len(arrived) < world and time.monotonic() < deadline:
            for other in range(world):
                if other not in arrived and store.check([f"hp_stall/{other}"]):
                    arrived[other] = store.get(f"hp_stall/{other}") == b"1"
            time.sleep(0.1)
    except Exception as error:  # no store reachable: each rank's own line must do
        return f"(could not compare with the other ranks: {error})" if rank == 0 else ""
    missing = [r for r in range(world) if not arrived.get(r, False)]
    silent = [r for r in range(world) if r not in arrived]
    note = f" (ranks {silent} did not answer)" if silent else ""
    return f"ranks {missing} did not arrive at the collective the others wait in{note}"


def stack_file(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` of ``run_distributed`` writes its stack dump.

    Example::

        >>> stack_file(Path("/tmp/stacks"), 1).name
        'rank-1.stack'
    """
    return directory / f"rank-{rank}.stack"

"""``run_distributed``: run a function on N local processes that share a process group.

The parent hosts the rendezvous store itself (on a port the OS picks, so there is
no race for a "free" port), starts one process per rank from a forkserver that
has already imported torch, and collects each rank's result or traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from hyper_parallel.platform_torch import comm
from hyper_parallel.platform_torch.devices import backend_for
from hyper_parallel.platform_torch.stalls import (
    STACK_SIGNAL,
    RankStack,
    describe_stall,
    parse_stack,
    register_stack_dump,
    stack_file,
)

__all__ = [
    "INIT_BARRIER_VAR",
    "PROCESS_GROUP_MARGIN_S",
    "DistributedRunError",
    "StartMethod",
    "lost_peer",
    "run_distributed",
]

R = TypeVar("R")
StartMethod = Literal["forkserver", "spawn"]

#: forkserver: the server imports torch once and forks a ready process per rank
#: (measured ~4x faster than spawn for 4 ranks); ``fork`` is never used because
#: forking a process whose torch threads already run can deadlock.
DEFAULT_START_METHOD: StartMethod = "forkserver"
# Imported once in the forkserver, so ranks fork with them loaded. torch's meta-kernel
# registrations are imported lazily by the first op on a meta tensor, which costs seconds
# per process; DTensor engines run such ops to plan sharding.
_PRELOAD = ["torch", "torch.distributed", "torch._meta_registrations", __name__]
# After the first failure, how long to let the other ranks report before killing them.
_FAILURE_GRACE_S = 2.0
# ... when that failure is a rank that died without a report (killed, crashed, out of memory):
# its peers' reports say which collective it broke (PeerLostError), so they get longer.
_DEATH_GRACE_S = 10.0
_EXIT_PARENT_GONE = 70
# The process group's timeout is the run's plus this, so that on a stall the launcher (which
# names the ranks that did not arrive) reports before a waiting rank's collective times out.
PROCESS_GROUP_MARGIN_S = 60.0
# How long the ranks get to write their stacks after SIGUSR1.
_STACK_GRACE_S = 3.0
#: torch.distributed's switch for a store-based barrier after each process group's creation.
INIT_BARRIER_VAR = "TORCH_DIST_INIT_BARRIER"


class DistributedRunError(RuntimeError):
    """One or more ranks of :func:`run_distributed` failed or did not finish in time.

    ``failures`` maps each failing rank to its traceback (or exit description), in
    the order the failures arrived (the first is usually the cause);
    ``unfinished`` lists the ranks that were still running when the run was stopped;
    after a timeout, ``stacks`` holds each unfinished rank's Python stack (faulthandler)
    and ``not_arrived`` the ranks the others were waiting for in a collective.
    """

    def __init__(
        self,
        message: str,
        failures: Mapping[int, str],
        unfinished: Sequence[int],
        *,
        stacks: Mapping[int, str] | None = None,
        not_arrived: Sequence[int] = (),
    ):
        super().__init__(message)
        self.failures = dict(failures)
        self.unfinished = list(unfinished)
        self.stacks = dict(stacks or {})
        self.not_arrived = list(not_arrived)


def run_distributed(
    fn: Callable[..., R],
    world_size: int,
    *,
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
    device_type: str = "cpu",
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    start_method: StartMethod = DEFAULT_START_METHOD,
    preload: Sequence[str] = (),
) -> list[R]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local ranks; return their results in rank order.

    Each rank runs in its own process with ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set (plus ``env``, applied over this
    process's environment) and the default process group initialised for
    ``device_type``; on CPU it calls ``torch.set_num_threads(1)``. ``fn``, the
    arguments and the results must be picklable (``fn`` defined at module level).
    The process group is destroyed when ``fn`` returns.

    Raises ``DistributedRunError`` naming every failing rank with its traceback,
    or, after ``timeout_s``, the ranks that had not finished, which of them wait in a
    collective and which ranks did not arrive, with each unfinished rank's Python stack;
    the other ranks are killed, never left behind. Ctrl-C kills all ranks and re-raises.
    The process group's timeout is ``timeout_s`` plus :data:`PROCESS_GROUP_MARGIN_S`, so
    a stall is reported by the launcher, not by a collective timing out first.

    ``preload`` names modules the forkserver imports once, so that ranks start
    with them loaded; it takes effect only when this process's forkserver is
    first started.

    Example::

        >>> def rank_squared() -> int:  # at module level in real code
        ...     return dist.get_rank() ** 2
        >>> run_distributed(rank_squared, 3)  # doctest: +SKIP
        [0, 1, 4]
    """
    payload = _checked_payload(fn, world_size, timeout_s, device_type, args, kwargs)
    context = _context(start_method, preload)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False
    )
    base_env = _ranks_environment(store.port, world_size, env)
    processes: list[BaseProcess] = []
    readers: list[Connection] = []
    keep_alive: list[Connection] = []
    stack_dir = tempfile.TemporaryDirectory(prefix="hp-stacks-")
    stacks: dict[int, RankStack] = {}
    try:
        for rank in range(world_size):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            process, reader, alive_writer = _start_rank(
                context, rank, (payload, rank_env, device_type, timeout_s), stack_dir.name
            )
            processes.append(process)
            readers.append(reader)
            keep_alive.append(alive_writer)
        results, failures, unfinished, timed_out = _collect(processes, readers, timeout_s)
        if not (failures or unfinished):
            for finished in processes:  # let every rank finish tearing down its group
                finished.join(timeout=5.0)
        if timed_out:
            stacks = _collect_stacks(processes, unfinished, Path(stack_dir.name))
    finally:
        _stop(processes, keep_alive)
        for reader in readers:
            reader.close()
        del store
        stack_dir.cleanup()
    if failures or unfinished:
        not_arrived, stall_lines = describe_stall(stacks, sorted(results)) if stacks else ([], [])
        raise DistributedRunError(
            _failure_message(fn, world_size, timeout_s, failures, unfinished, timed_out)
            + _stall_message(stacks, stall_lines),
            failures,
            unfinished,
            stacks={rank: stack.text for rank, stack in stacks.items()},
            not_arrived=not_arrived,
        )
    return [results[rank] for rank in range(world_size)]


def _checked_payload(
    fn: Callable[..., object],
    world_size: object,
    timeout_s: float,
    device_type: str,
    args: Sequence[object],
    kwargs: Mapping[str, object] | None,
) -> bytes:
    """The pickled call, after checking the arguments (nothing has been started yet)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"run_distributed: timeout_s must be > 0, got {timeout_s}")
    backend_for(device_type)
    try:
        return pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise TypeError(
            f"run_distributed: fn and its arguments must be picklable (define fn at module "
            f"level); pickling {_describe(fn)} failed: {error}"
        ) from error


def _context(start_method: StartMethod, preload: Sequence[str]) -> ForkServerContext | SpawnContext:
    if start_method != "forkserver":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Only takes effect when this process's forkserver is first started.
    context.set_forkserver_preload([*_PRELOAD, *preload])
    return context


def _ranks_environment(port: int, world_size: int, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment every rank shares (``RANK``/``LOCAL_RANK`` are added per rank)."""
    # torch's barrier after each process group's creation (off by default since torch 2.1):
    # without it a rank whose fn needs no collective can finish and close its sockets while a
    # slower peer is still inside gloo's connectFullMesh, which then fails with "Connection
    # closed by peer" (seen under load); with it no rank leaves init_process_group or
    # new_group before every member has connected. Set to "0" in env to opt out.
    base_env = {INIT_BARRIER_VAR: "1", **os.environ, **(env or {})}
    base_env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # The rendezvous store is the one this process hosts: every rank is a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return base_env


def _start_rank(
    context: ForkServerContext | SpawnContext,
    rank: int,
    job: tuple[bytes, dict[str, str], str, float],
    stack_dir: str,
) -> tuple[BaseProcess, Connection, Connection]:
    """Start one rank's process on ``job`` (payload, env, device type, timeout).

    Returns the process, the end its report arrives on, and the end whose closing tells
    it that this process is gone.
    """
    payload, rank_env, device_type, timeout_s = job
    reader, writer = context.Pipe(duplex=False)
    alive_reader, alive_writer = context.Pipe(duplex=False)
    process: BaseProcess = context.Process(
        target=_run_rank,
        args=(payload, rank_env, device_type, timeout_s, writer, alive_reader, stack_dir),
        name=f"hyper-parallel-rank-{rank}",
    )
    process.start()
    writer.close()
    alive_reader.close()
    return process, reader, alive_writer


def _collect(
    processes: list[BaseProcess], readers: list[Connection], timeout_s: float
) -> tuple[dict[int, Any], dict[int, str], list[int], bool]:
    """Wait for every rank's report until all reported, one failed (plus grace), or timeout."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = set(range(len(processes)))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while pending:
        now = time.monotonic()
        if now >= deadline:
            timed_out = not failures
            break
        waitables: list[Any] = [readers[rank] for rank in pending]
        waitables += [processes[rank].sentinel for rank in pending]
        wait(waitables, timeout=deadline - now)
        for rank in sorted(pending):
            report = _read_report(processes[rank], readers[rank])
            if report is None:
                continue
            pending.discard(rank)
            status, value = report
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
                grace = _DEATH_GRACE_S if status == "died" else _FAILURE_GRACE_S
                deadline = min(deadline, time.monotonic() + grace)
    return results, failures, sorted(pending), timed_out


def _read_report(process: BaseProcess, reader: Connection) -> tuple[str, Any] | None:
    """A rank's ``("ok", result)`` / ``("error", text)`` / ``("died", text)``, or None while it runs."""
    if reader.poll(0):
        try:
            status, value = pickle.loads(reader.recv_bytes())
        except EOFError:
            pass
        except Exception:
            return "error", f"its result could not be unpickled:\n{traceback.format_exc()}"
        else:
            return status, value
    if process.is_alive():
        return None
    return "died", f"process exited with {_describe_exit(process.exitcode)} without a result"


def _collect_stacks(
    processes: list[BaseProcess], ranks: Sequence[int], directory: Path
) -> dict[int, RankStack]:
    """Ask every rank in ``ranks`` for its Python stack (SIGUSR1 → faulthandler) and read them."""
    asked = []
    for rank in ranks:
        pid = processes[rank].pid
        if pid is not None and processes[rank].is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, STACK_SIGNAL)
                asked.append(rank)
    paths = {rank: stack_file(directory, rank) for rank in asked}
    deadline = time.monotonic() + _STACK_GRACE_S
    while time.monotonic() < deadline and not all(
        p.exists() and p.stat().st_size > 0 for p in paths.values()
    ):
        time.sleep(0.05)
    time.sleep(0.2)  # faulthandler writes the whole dump at once; let the last one finish
    found = {}
    for rank in ranks:
        path = paths.get(rank)
        text = path.read_text() if path is not None and path.exists() else ""
        found[rank] = parse_stack(text) if text else RankStack("", None, "unknown (no stack)")
    return found


def _stall_message(stacks: Mapping[int, RankStack], lines: Sequence[str]) -> str:
    if not stacks:
        return ""
    parts = ["", *lines]
    for rank, stack in sorted(stacks.items()):
        text = stack.text.rstrip() or "(no stack: the rank did not answer SIGUSR1)"
        parts.append(f"--- rank {rank} Python stack (most recent call first) ---\n{text}")
    return "\n".join(parts)


def _stop(processes: list[BaseProcess], keep_alive: list[Connection]) -> None:
    """Kill every rank still running and reap all of them (never leave orphans)."""
    for alive_writer in keep_alive:
        alive_writer.close()  # ranks watching it exit on their own
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 2.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def lost_peer(error: BaseException) -> comm.CollectiveError | None:
    """The :class:`~hyper_parallel.platform_torch.comm.CollectiveError` behind ``error``, if any.

    A lost peer (:class:`~hyper_parallel.platform_torch.comm.PeerLostError`) or a collective
    past its timeout; its ``line`` names the collective, the group (mesh axis) and the peers.

    Example::

        >>> lost_peer(RuntimeError("unrelated")) is None
        True
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, comm.CollectiveError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", "?")
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _failure_message(
    fn: object,
    world_size: int,
    timeout_s: float,
    failures: Mapping[int, str],
    unfinished: Sequence[int],
    timed_out: bool,
) -> str:
    head = f"run_distributed({_describe(fn)}, world_size={world_size})"
    if timed_out:
        finished = sorted(set(range(world_size)) - set(unfinished))
        lines = [
            f"{head}: timed out after {timeout_s:g} s; ranks {list(unfinished)} had not "
            f"finished (finished: {finished}); they were killed"
        ]
    else:
        first = next(iter(failures))
        lines = [
            f"{head}: {len(failures)} of {world_size} ranks failed {sorted(failures)}; "
            f"rank {first} failed first (tracebacks below in the order they arrived)"
        ]
        if unfinished:
            lines.append(f"ranks {list(unfinished)} were still running and were killed")
    for rank in failures:
        lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
    return "\n".join(lines)


# -- inside each rank's process ------------------------------------------------
def _exit_when_parent_dies(alive_reader: Connection) -> None:
    """Exit this rank as soon as the parent closes its end of ``alive_reader`` or dies."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            alive_reader.recv_bytes()
        os._exit(_EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _run_rank(
    payload: bytes,
    env: dict[str, str],
    device_type: str,
    timeout_s: float,
    writer: Connection,
    alive_reader: Connection,
    stack_dir: str,
) -> None:
    """Body of one rank's process: set up, run ``fn``, report, tear down."""
    _exit_when_parent_dies(alive_reader)
    os.environ.clear()
    os.environ.update(env)
    rank = int(env["RANK"])
    stack_out = open(stack_file(Path(stack_dir), rank), "w")  # noqa: SIM115 - open while fn runs
    register_stack_dump(stack_out)
    report: bytes
    try:
        if device_type == "cpu":
            torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        comm.init_process_group(device_type, timeout_s=timeout_s + PROCESS_GROUP_MARGIN_S)
        result = fn(*args, **kwargs)
        try:
            report = pickle.dumps(("ok", result))
        except Exception as error:
            raise TypeError(
                f"the result of {_describe(fn)} ({type(result).__name__}) is not picklable"
            ) from error
    except BaseException as error:
        text = traceback.format_exc()
        lost = lost_peer(error)
        # a lost peer's one line (collective, mesh axis, peer ranks) above the traceback
        report = pickle.dumps(("error", f"{lost.line}\n{text}" if lost is not None else text))
    writer.send_bytes(report)
    writer.close()
    if comm.is_initialized():
        dist.destroy_process_group()

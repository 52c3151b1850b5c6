"""A stalled rank is reported within the launcher's timeout, naming the ranks that did not arrive (#12 item 11)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from tests._harness import run_on_ranks

from hyper_parallel.platform_torch.launch import DistributedRunError
from hyper_parallel.platform_torch.stalls import RankStack, describe_stall, parse_stack

TIMEOUT_S = 8.0


def _rank_one_stalls_before_the_all_reduce() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)  # never reaches the collective rank 0 waits in
    dist.all_reduce(torch.ones(1))


def test_a_stalled_rank_is_named_with_every_ranks_stack_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as caught:
        run_on_ranks(_rank_one_stalls_before_the_all_reduce, 2, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    error = caught.value
    message = str(error)
    assert error.not_arrived == [1] and sorted(error.stacks) == [0, 1]
    assert "ranks [1] did not arrive at the collective that ranks [0] wait in" in message
    assert "rank 0 waits in torch.distributed all_reduce" in message
    assert "rank 1 did not arrive at a collective: it is at " in message
    assert "in _rank_one_stalls_before_the_all_reduce" in error.stacks[1]
    assert "in all_reduce" in error.stacks[0] and "in all_reduce" not in error.stacks[1]
    assert "--- rank 1 Python stack (most recent call first) ---" in message
    # reported by the launcher, not after the process group's own timeout
    assert elapsed < TIMEOUT_S + 30


DUMP = """\
Thread 0x00007f0f685ff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f1024c0bb80 (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/v/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/w/model.py", line 7 in step
  File "/w/launch.py", line 388 in _run_rank
"""


def test_parse_stack_finds_the_collective_and_its_caller() -> None:
    stack = parse_stack(DUMP)
    assert stack.waiting_in == "all_reduce" and stack.at == "/w/model.py:7 in step"
    busy = parse_stack(DUMP.replace("torch/distributed", "torch/nn"))
    assert busy.waiting_in is None and busy.at.endswith("distributed_c10d.py:3913 in all_reduce")
    assert parse_stack(DUMP, main_ident=0x00007F0F685FF6C0).at.endswith("threading.py:982 in run")
    assert parse_stack("").at == "unknown (no stack)"


def test_describe_stall_when_every_unfinished_rank_waits() -> None:
    waiting = RankStack("", "broadcast", "m.py:1 in f")
    assert describe_stall({0: waiting, 1: waiting})[0] == []
    assert "mismatched collectives?" in describe_stall({0: waiting, 1: waiting})[1][-1]
    # a rank that returned (its process still up) did not arrive either
    not_arrived, lines = describe_stall({0: waiting}, returned=[1])
    assert not_arrived == [1]
    assert lines[0] == "ranks [1] did not arrive at the collective that ranks [0] wait in"

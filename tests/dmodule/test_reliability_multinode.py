"""Multi-node as users run it: two torchrun agents ("nodes") of 2 workers on one machine (#19 item 9).

Parity of the demo (tp=2 x dp=2 across the two agents), and the loss of one node (its
agent and workers killed): the other node's workers each print one line naming the
collective, the mesh axis and the peer ranks, and its agent exits non-zero within 60 s,
leaving no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.dim=32", "--model.n_layers=1", "--model.vocab_size=64", "--model.ffn_dim=48"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _agent(port: int, pid_dir: Path, demo_args: list[str], step_s: float) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(HP_TEST_PID_DIR=str(pid_dir), HP_TEST_STEP_S=str(step_s))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--max-restarts=0",
        # the agent stops its other workers once one fails: leave them time to report too
        "--monitor-interval=2",
        "-m",
        "tests.dmodule._reliability_node",
        "--tp",
        "2",
        "--dp",
        "2",
        "--seq-len",
        "8",
        *TINY,
        *demo_args,
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killed as one "node"
    )


def _two_nodes(
    pid_dir: Path, demo_args: list[str], step_s: float = 0.0
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    port = _free_port()
    first = _agent(port, pid_dir, demo_args, step_s)
    deadline = time.monotonic() + 60
    while not _listening(port) and time.monotonic() < deadline:  # it hosts the rendezvous
        time.sleep(0.1)
    return first, _agent(port, pid_dir, demo_args, step_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _workers(pid_dir: Path) -> dict[int, tuple[int, int]]:
    """rank -> (worker pid, its agent's pid)."""
    found = {}
    for path in pid_dir.glob("rank*.pid"):
        pid, agent = path.read_text().split()
        found[int(path.stem[4:])] = (int(pid), int(agent))
    return found


def _stop(agents: tuple[subprocess.Popen[str], ...], pid_dir: Path) -> None:
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    for pid, _ in _workers(pid_dir).values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_demo_on_two_torchrun_agents_keeps_parity(tmp_path: Path) -> None:
    plot = ["--plot", str(tmp_path / "p.png")]
    agents = _two_nodes(tmp_path, ["--steps", "2", *plot])
    try:
        outputs = [agent.communicate(timeout=400)[0] for agent in agents]
    finally:
        _stop(agents, tmp_path)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    assert any("PASS" in out for out in outputs), "\n".join(outputs)
    assert sorted(_workers(tmp_path)) == [0, 1, 2, 3]


def test_losing_a_node_ends_the_other_within_60_s_naming_the_lost_peers(tmp_path: Path) -> None:
    agents = _two_nodes(tmp_path, ["--steps", "200", "--plot", str(tmp_path / "p.png")], 0.2)
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("rank*.stepped"))) < 4 and time.monotonic() < deadline:
            assert all(agent.poll() is None for agent in agents), "an agent ended before training"
            time.sleep(0.1)
        workers = _workers(tmp_path)
        lost, kept = agents[1], agents[0]
        lost_ranks = sorted(r for r, (_, agent) in workers.items() if agent == lost.pid)
        kept_ranks = sorted(r for r, (_, agent) in workers.items() if agent == kept.pid)
        assert len(lost_ranks) == len(kept_ranks) == 2, workers
        os.killpg(lost.pid, signal.SIGKILL)  # the agent and, separately, its workers
        for rank in lost_ranks:
            if _alive(workers[rank][0]):
                os.kill(workers[rank][0], signal.SIGKILL)
        killed_at = time.monotonic()
        output = kept.communicate(timeout=120)[0]
        ended_s = time.monotonic() - killed_at
    finally:
        _stop(agents, tmp_path)
    assert kept.returncode != 0, output
    assert ended_s < 60, output
    reported = 0
    for rank in kept_ranks:  # a rank its agent stopped before its collective failed has none
        lines = [line for line in output.splitlines() if f"demo FAILED: rank {rank}: lost" in line]
        assert len(lines) <= 1, output
        for line in lines:
            assert " on mesh axis " in line and "one of peer ranks [" in line, line
            reported += 1
    assert reported >= 1, output
    assert "Traceback" in output  # kept below each line
    time.sleep(2)
    assert [r for r in kept_ranks if _alive(workers[r][0])] == []  # no orphans

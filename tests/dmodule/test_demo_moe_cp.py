"""The demo's ParallelDims layouts end to end: qwen3-moe under ep, llama-ref under cp (2 ranks;
with pp, 4)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.dmodule.test_demo import TINY, _demo

STEPS, BATCH, SEQ = 2, 8, 8


def _run(tmp_path: Path, *args: str, model: list[str] = TINY) -> str:
    plot = tmp_path / "curve.png"
    common = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    done = _demo([*args, *common, "--plot", str(plot), *model])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and plot.exists()
    steps = re.findall(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.e+-]+$", done.stdout, re.MULTILINE)
    assert [int(s) for s in steps] == list(range(1, STEPS + 1))  # every step compared
    return done.stdout


def test_demo_qwen3_moe_ep2_passes_parity_and_reports_the_experts_load(tmp_path: Path) -> None:
    out = _run(tmp_path, "--model", "qwen3-moe", "--ep", "2", "--tp", "1", "--experts", "4")
    assert "hp-dmodule demo: qwen3-moe" in out and "ep=2 (4 experts)" in out
    per_expert = re.search(r"tokens per expert \(.*\): \[([\d, ]+)\]", out)
    assert per_expert is not None, out
    counts = [int(c) for c in per_expert.group(1).split(",")]
    # every token of every step reaches its top-2 experts once (1 MoE block)
    assert len(counts) == 4 and sum(counts) == STEPS * BATCH * SEQ * 2
    ranks = re.findall(r"rank (\d): +(\d+) tokens +expert weights +(\d+) of (\d+)", out)
    assert [r[0] for r in ranks] == ["0", "1"]
    # rank r holds experts 2r, 2r+1 and computes exactly the tokens routed to them
    assert [int(r[1]) for r in ranks] == [counts[0] + counts[1], counts[2] + counts[3]]
    assert all(2 * int(r[2]) == int(r[3]) for r in ranks)  # half the expert weights each
    assert re.search(r"collectives over 'ep'.*\n\s+all_to_all\s+x\d+", out)


def test_demo_llama_pp2_cp2_ring_packed_passes_parity_and_reports_each_stage(
    tmp_path: Path,
) -> None:
    two_blocks = [arg for arg in TINY if not arg.startswith("--model.n_layers")]
    out = _run(
        tmp_path,
        *("--pp", "2", "--cp", "2", "--tp", "1", "--cp-attention", "ring", "--packed"),
        model=[*two_blocks, "--model.n_layers=2"],
    )
    assert "cp=2 (ring) packed documents pp=2 (1F1B) on 4 cpu processes" in out
    one = re.search(r"one process: ([\d.]+) KiB", out)
    assert one is not None, out
    blocks = re.findall(r"rank (\d) \(stage (\d), block (\d)\): +([\d.]+) KiB", out)
    # pp is the outer axis: ranks 0, 1 run block 0 (stage 0), ranks 2, 3 block 1 (stage 1)
    assert [b[:3] for b in blocks] == [
        ("0", "0", "0"),
        ("1", "0", "0"),
        ("2", "1", "1"),
        ("3", "1", "1"),
    ]
    # a block runs on one microbatch (of 2) of its cp rank's half of the sequence
    assert all(4 * float(b[3]) == float(one.group(1)) for b in blocks)
    assert re.search(
        r"collectives over 'cp'[^\n]*stage 0's[^\n]*\n(\s+\w+\s+x\d+[^\n]*\n)*"
        r"\s+send_recv",
        out,
    )


def test_demo_llama_cp2_ring_packed_passes_parity_and_halves_activations(tmp_path: Path) -> None:
    out = _run(tmp_path, "--cp", "2", "--tp", "1", "--cp-attention", "ring", "--packed")
    assert "cp=2 (ring)" in out and "packed documents" in out
    one = re.search(r"one process: ([\d.]+) KiB", out)
    assert one is not None, out
    per_rank = [float(k) for k in re.findall(r"rank \d: +([\d.]+) KiB", out)]
    assert len(per_rank) == 2 and all(2 * k == float(one.group(1)) for k in per_rank)
    assert re.search(r"collectives over 'cp'[^\n]*\n(\s+\w+\s+x\d+[^\n]*\n)*\s+send_recv", out)


def test_demo_rejects_layouts_that_do_not_compose_before_starting_ranks() -> None:
    done = _demo(["--ep", "2"])
    assert done.returncode == 2 and "--ep needs --model qwen3-moe" in done.stderr
    done = _demo(["--model", "qwen3-moe", "--ep", "3", "--experts", "8"])
    assert done.returncode == 2 and "--experts 8 must divide by --ep 3" in done.stderr
    done = _demo(["--cp", "2", "--seq-len", "6"])
    assert done.returncode == 2 and "--seq-len 6 must divide by 2 x --cp = 4" in done.stderr
    done = _demo(["--cp", "2", "--tp", "2", "--cp-attention", "alltoall"])
    assert done.returncode == 2 and "n_kv_heads 2 / --tp 2) to divide by --cp 2" in done.stderr

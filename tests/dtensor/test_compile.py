"""``torch.compile`` over code that holds hp DTensors: a clean graph break at every DTensor op.

Oracle: the same model or function run eagerly on the same ranks and inputs: the same
output (type, placements, values), the same gradients and the same collectives, kind by
kind and byte by byte. The graph breaks are read from ``torch._dynamo.explain`` and
pinned: every one is a DTensor op or a call into hp-dtensor, and the plain-tensor code
between them is still captured in graphs. One 2-rank launch covers every case (the first
compile costs tens of seconds).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from torch import nn

from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    init_device_mesh,
)
from hyper_parallel.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Block(nn.Module):
    """A norm and a residual on plain tensors around a TP MLP (hp DTensor weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain
        out: torch.Tensor = x + self.w2(F.gelu(self.w1(h)))
        return out


def _breaks(fn: Any, *inputs: Any) -> dict[str, Any]:
    """Compile ``fn`` afresh and call it once: its graph breaks by kind, graphs, ops captured.

    A break dynamo takes mid-frame is a ``graph_break``; one at a frame's first op makes
    dynamo run the whole frame eagerly (``unimplemented``). Both are counted, by kind: a
    call into hp-dtensor's (skipped) files, or an op on a DTensor (a non-traceable subclass).
    """
    import torch._dynamo

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled: Any = torch.compile(fn)
    compiled(*inputs)
    kinds: dict[str, int] = {}
    for reason, n in [*counters["graph_break"].items(), *counters["unimplemented"].items()]:
        if "marked as skipped" in reason and "hyper_parallel/dtensor" in reason:
            kind = "hp-dtensor call"
        elif "DTensor" in reason:
            kind = "DTensor op"
        else:
            kind = reason.splitlines()[0]
        kinds[kind] = kinds.get(kind, 0) + n
    return {
        "breaks": kinds,
        "graphs": counters["stats"]["unique_graphs"],
        "ops": counters["stats"]["calls_captured"],
    }


def _run(
    fn: Any, make_input: Any, params: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[str, int]]]:
    """Output, input and parameter gradients and collectives of one forward + backward."""
    x = make_input()
    for p in params:
        p.grad = None
    with CommDebugMode() as comm:
        y = fn(x)
        (y.to_local() if isinstance(y, DTensor) else y).pow(2).sum().backward()
    grads = [x.grad, *[p.grad for p in params]]
    return y.detach(), [_local(g) for g in grads], [(r.kind, r.nbytes) for r in comm.records()]


def _local(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.to_local() if isinstance(t, DTensor) else t


def _compile_cases() -> dict[str, Any]:
    import torch._dynamo

    torch.set_num_threads(1)
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    # (a) torch.compile(model) of a TP model: values, gradients and collectives of eager
    torch.manual_seed(0)
    eager = Block()
    compiled_block = Block()
    compiled_block.load_state_dict(eager.state_dict())
    for block in (eager, compiled_block):
        parallelize_module(block, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    compiled = torch.compile(compiled_block)
    counters = torch._dynamo.utils.counters
    graphs = []
    for step in range(2):  # a second step of the same shape recompiles nothing
        torch.manual_seed(10 + step)
        x_full = torch.randn(2, 4, 8)

        def make(x_full: torch.Tensor = x_full) -> torch.Tensor:
            return x_full.clone().requires_grad_()

        want = _run(eager, make, list(eager.parameters()))
        got = _run(compiled, make, list(compiled_block.parameters()))
        assert type(got[0]) is type(want[0]) is torch.Tensor
        assert_close_to_scale(got[0], want[0], what=f"output, step {step}")
        for i, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
            assert_close_to_scale(g, w, what=f"gradient {i}, step {step}")
        assert got[2] == want[2], (got[2], want[2])
        graphs.append(counters["stats"]["unique_graphs"])
    out["model_collectives"] = [kind for kind, _ in want[2]]
    out["model_graphs"] = graphs
    # (b) the graph breaks, pinned: where they fall, and what still compiles
    out["model"] = _breaks(compiled_block, torch.randn(2, 4, 8))

    # (c) a compiled plain function given a DTensor: eager's result, op by op
    def pointwise(t: torch.Tensor) -> torch.Tensor:
        return (t * 2).sin() + 1

    def local_math(t: DTensor) -> DTensor:
        local = t.to_local()
        local = torch.relu(local * 3) + local.cos()  # plain tensors: compiled
        return DTensor.from_local(local, t.device_mesh, t.placements)

    for name, fn in (("pointwise", pointwise), ("local_math", local_math)):
        torch._dynamo.reset()
        torch.manual_seed(1)
        full = torch.randn(4, 6)

        def make_dt(full: torch.Tensor = full) -> DTensor:
            return distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()

        want = _run(fn, make_dt, [])
        got = _run(torch.compile(fn), make_dt, [])
        assert isinstance(got[0], DTensor) and isinstance(want[0], DTensor)
        assert got[0].placements == want[0].placements == (Shard(0),)
        assert_close_to_scale(got[0].to_local(), want[0].to_local(), what=name)
        assert_close_to_scale(got[1][0], want[1][0], what=f"{name} gradient")
        assert got[2] == want[2]
        out[name] = _breaks(fn, make_dt())

    # a collective of hp-dtensor inside compiled code: an eager call, observed every time
    def reduced(t: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(t.sin() * 2, mesh, "tp").cos()

    torch._dynamo.reset()
    compiled_reduced = torch.compile(reduced)
    seen = []
    for _ in range(2):
        with CommDebugMode() as comm:
            summed = compiled_reduced(torch.ones(3))
        seen.append([r.kind for r in comm.records()])
    assert seen == [["all_reduce"], ["all_reduce"]], seen
    assert_close_to_scale(summed, reduced(torch.ones(3)), what="compiled all_reduce")
    # a replicated DTensor too: the result keeps its placement
    rep = distribute_tensor(torch.ones(3), mesh, [Replicate()])
    compiled_pointwise = torch.compile(pointwise)
    result = compiled_pointwise(rep)
    assert isinstance(result, DTensor) and result.placements == (Replicate(),)
    assert_close_to_scale(result.to_local(), pointwise(torch.ones(3)))
    return out


def test_compiled_code_breaks_cleanly_at_every_dtensor_op() -> None:
    for result in run_on_ranks(_compile_cases, 2, timeout_s=600.0):
        # two all-reduces forward (Rowwise output) and backward (Colwise input grad)
        assert result["model_collectives"] == ["all_reduce", "all_reduce"]
        first, second = result["model_graphs"]
        assert first >= 1 and second == first, f"recompiled: {result['model_graphs']}"
        # two breaks, both into hp-dtensor: ColwiseParallel's input hook (from_local) and
        # RowwiseParallel's output hook (to_local); the norm before, the residual after and
        # the GELU between compile (3 graphs, no DTensor inside any)
        assert result["model"] == {"breaks": {"hp-dtensor call": 2}, "graphs": 3, "ops": 8}
        # an op on a DTensor at a frame's start: dynamo runs the frame eagerly, no graph
        assert result["pointwise"] == {"breaks": {"DTensor op": 1}, "graphs": 0, "ops": 0}
        # to_local and from_local break the graph; the math on the shard between compiles
        assert result["local_math"] == {"breaks": {"hp-dtensor call": 2}, "graphs": 1, "ops": 4}


def test_registration_waits_for_dynamo_and_happens_when_it_loads() -> None:
    # a fresh interpreter: importing hp-dtensor does not import dynamo (seconds), and
    # importing dynamo afterwards registers DTensor and skips hp-dtensor's files
    code = (
        "import sys, hyper_parallel.dtensor as hp\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "import torch._dynamo, torch._dynamo.trace_rules as rules\n"
        "assert hp.DTensor in torch._dynamo.config.nontraceable_tensor_subclasses\n"
        "assert rules.check_file(hp.DTensor.to_local.__code__.co_filename).skipped\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]

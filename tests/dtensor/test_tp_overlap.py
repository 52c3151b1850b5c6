"""ColwiseParallel's input-gradient all-reduce overlapped with its weight-gradient matmul."""

from __future__ import annotations

import copy
from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from torch import nn

from hyper_parallel.dtensor import CommDebugMode, DTensor, Replicate, init_device_mesh
from hyper_parallel.dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    overlap_grad_reduce,
    parallelize_module,
)


def _graph_names(tensor: torch.Tensor) -> set[str]:
    """The class names of the autograd nodes ``tensor`` was computed through."""
    names: set[str] = set()
    visited: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _TwoHeads(nn.Module):
    """One replicated input feeding two column-parallel linears (as wq/wk/wv share x)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) * self.b(x)
        return out


def _shared_input_counts(mesh: Any, enabled: bool) -> dict[str, Any]:
    """Backward collectives of two colwise linears sharing one replicated DTensor input."""
    torch.manual_seed(0)
    model = _TwoHeads()
    parallelize_module(
        model,
        mesh,
        PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
    )
    parallelize_module(model, mesh, {"a": ColwiseParallel(), "b": ColwiseParallel()})
    leaf = torch.randn(3, 8, requires_grad=True)
    with overlap_grad_reduce(enabled):
        loss = model(leaf).sum()
    with CommDebugMode() as comm:
        loss.backward()
    return {
        "counts": comm.counts(),
        "overlapped": "_ColwiseOverlappedBackward" in _graph_names(loss),
    }


def _overlap_on_and_off() -> dict[str, Any]:
    """On each rank: a TP MLP's input and weight gradients with the overlap on and off."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(3, 5, 8)
    ref = copy.deepcopy(base)
    ref_x = x.clone().requires_grad_()
    ref(ref_x).square().sum().backward()
    want = [ref_x.grad, *(p.grad for p in ref.parameters())]
    plan: dict[str, ParallelStyle] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    found: dict[str, Any] = {"want": want}
    for enabled in (True, False):
        model = parallelize_module(copy.deepcopy(base), mesh, plan)
        leaf = x.clone().requires_grad_()
        with overlap_grad_reduce(enabled):
            loss = model(leaf).square().sum()
        with CommDebugMode() as comm:
            loss.backward()
        found[str(enabled)] = {
            "grads": [leaf.grad, *(_full(p.grad) for p in model.parameters())],  # type: ignore[arg-type]
            "backward_collectives": comm.counts(),
            "overlapped": "_ColwiseOverlappedBackward" in _graph_names(loss),
            "shared": _shared_input_counts(mesh, enabled),
        }
    return found


def test_colwise_overlap_gives_the_same_gradients_and_collectives_as_without() -> None:
    for rank, found in enumerate(run_on_ranks(_overlap_on_and_off, 2)):
        on, off = found["True"], found["False"]
        assert on["overlapped"] and not off["overlapped"], f"rank {rank}"
        assert on["backward_collectives"] == off["backward_collectives"], f"rank {rank}"
        assert on["backward_collectives"].get("all_reduce") == 1, on["backward_collectives"]
        # a shared replicated DTensor input: its summed gradient is reduced once, not per linear
        assert on["shared"]["counts"] == off["shared"]["counts"] == {"all_reduce": 1}, on
        assert not on["shared"]["overlapped"]
        for got_on, got_off, want in zip(on["grads"], off["grads"], found["want"], strict=True):
            assert_close_to_scale(got_on, want, rel=1e-5)
            assert_close_to_scale(got_off, want, rel=1e-5)

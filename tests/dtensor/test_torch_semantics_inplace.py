"""In-place and ``out=`` ops keep the layout of the tensor they write, as torch's do.

Ported from torch's DTensor in-place tests (``test_inplace_op``, ``test_out_variant``,
``test_copy_``): a written DTensor keeps its placements; where torch raises because
no layout keeps them, the op runs through the fallback and writes its result back
in the target's layout (a deliberate difference, listed in the README); views taken
before the op see its result; ``copy_`` and
``load_state_dict`` redistribute the incoming value to the target's layout. Oracles:
torch.distributed.tensor on the same inputs (placements, collectives, whether it
raises) and the same ops on full tensors in one process (values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._torch_twin import Side, close, full, layout, sides

from hyper_parallel.dtensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    fallback_counts,
    init_device_mesh,
    reset_fallback_counts,
)

_X = torch.arange(1.0, 13.0).reshape(4, 3)
_Y = torch.arange(2.0, 14.0).reshape(4, 3).flip(0)


def _make(side: Side, kind: str, value: torch.Tensor) -> Any:
    """A DTensor of ``value``: ``"S0"``, ``"S1"``, ``"R"`` or ``"P"`` (its value split in halves)."""
    if kind == "P":
        n = side.mesh.size()
        rank = side.mesh.get_local_rank()
        return side.from_local(value * (rank + 1) * 2 / (n * (n + 1)), [side.Partial()])
    placement = {"S0": side.Shard(0), "S1": side.Shard(1), "R": side.Replicate()}[kind]
    return side.distribute(value.clone(), [placement])


# name -> (target kind, other kind or None, the op on (target, other), the full-tensor oracle)
_CASES: dict[str, tuple[str, str | None, Callable[[Any, Any], Any]]] = {
    "replicate.add_(shard)": ("R", "S0", lambda t, o: t.add_(o)),
    "shard.add_(replicate)": ("S0", "R", lambda t, o: t.add_(o)),
    "shard0.add_(shard1)": ("S0", "S1", lambda t, o: t.add_(o)),
    "partial.add_(1)": ("P", None, lambda t, o: t.add_(1)),
    "partial.mul_(2)": ("P", None, lambda t, o: t.mul_(2)),
    "partial.add_(partial)": ("P", "P", lambda t, o: t.add_(o)),
    "shard.mul_(partial)": ("S0", "P", lambda t, o: t.mul_(o)),
    "replicate.mul_(partial)": ("R", "P", lambda t, o: t.mul_(o)),
    "partial.mul_(replicate)": ("P", "R", lambda t, o: t.mul_(o)),
    "shard0.copy_(shard1)": ("S0", "S1", lambda t, o: t.copy_(o)),
    "replicate.copy_(partial)": ("R", "P", lambda t, o: t.copy_(o)),
    "partial.copy_(replicate)": ("P", "R", lambda t, o: t.copy_(o)),
    "shard.copy_(partial)": ("S1", "P", lambda t, o: t.copy_(o)),
    "partial.masked_fill_(mask, 2)": ("P", "R", lambda t, o: t.masked_fill_(o > 5, 2.0)),
    "partial.sub_(0.5)": ("P", None, lambda t, o: t.sub_(0.5)),
    "partial.zero_()": ("P", None, lambda t, o: t.zero_()),
    "partial.fill_(3)": ("P", None, lambda t, o: t.fill_(3.0)),
    "shard.fill_(3)": ("S0", None, lambda t, o: t.fill_(3.0)),
    "out=replicate of shard+shard": ("R", "S0", lambda t, o: torch.add(o, o, out=t)),
    "out=shard1 of replicate*replicate": ("S1", "R", lambda t, o: torch.mul(o, o, out=t)),
    "out=shard0 of shard0+shard0": ("S0", "S0", lambda t, o: torch.add(o, o, out=t)),
}

# hp-dtensor moves S(i) -> S(j) with one all-to-all; torch (on gloo) all-gathers and slices.
_ALL_TO_ALL_INSTEAD_OF_ALL_GATHER = {"shard0.copy_(shard1)", "shard0.add_(shard1)"}


# README: copy_ redistributes its source to the target's layout whatever the two are; torch
# has no Partial -> Shard path for copy_ and raises.
_COPY_WHERE_TORCH_RAISES = {"shard.copy_(partial)"}


# in-place ops on a Partial target that keep it Partial exactly, without a collective
_PARTIAL_KEPT_EXACTLY = {"partial.add_(1)", "partial.sub_(0.5)", "partial.masked_fill_(mask, 2)"}


def _in_place(side: Side) -> dict[str, Any]:
    out: dict[str, Any] = {}
    reset_fallback_counts()
    for name, (target_kind, other_kind, op) in _CASES.items():
        target = _make(side, target_kind, _X)
        other = _make(side, other_kind, _Y) if other_kind else None
        before = layout(target)
        view = target.view(-1) if target_kind != "S1" else None
        want_target = full(target).clone()
        want_other = full(other).clone() if other is not None else None
        try:
            with side.comm() as counts:
                result = op(target, other)
        except RuntimeError as exc:
            out[name] = {"raised": str(exc).splitlines()[0], "unchanged": before == layout(target)}
            continue
        want = op(want_target, want_other)
        if name == "partial.fill_(3)":
            want = want * side.mesh.size()  # torch: every rank's part is 3, their sum n * 3
        got = full(target)
        out[name] = {
            "layout_kept": layout(target) == before,
            "returns_target": result is target,
            "layout": layout(target),
            "comm": counts,
            "value": close(got, want),
            "view_sees_it": view is None or close(full(view), want.reshape(-1)),
            "fell_back": side.name == "hp" and bool(fallback_counts()),
        }
        reset_fallback_counts()
    return out


def _run_both(world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    ours, theirs = sides((world_size,))
    return _in_place(ours), _in_place(theirs)


@pytest.mark.allows_fallback
@world_sizes(2, 4)
def test_in_place_and_out_ops_keep_the_written_layout_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_run_both, world_size, world_size):
        for name, mine in ours.items():
            torch_result = theirs[name]
            torch_refuses_layout = "raised" in torch_result and (
                "placement changes" not in torch_result["raised"]
            )  # e.g. torch has no strategy for an uneven shard: nothing to compare but values
            if torch_refuses_layout:
                assert mine.get("value") and mine["layout_kept"], (name, mine)
                continue
            assert "raised" not in mine, f"{name}: raised {mine['raised']}; torch: {torch_result}"
            assert mine["layout_kept"] and mine["returns_target"], (name, mine)
            assert mine["value"] and mine["view_sees_it"], (name, mine)
            if "raised" in torch_result and name not in _COPY_WHERE_TORCH_RAISES:
                # README: where torch raises "in-place operations that require placement
                # changes are not supported", the target keeps its layout and storage: a
                # scalar added to / filled into a Partial goes to one rank per sum axis (no
                # collective), anything else runs through the fallback (warned, counted).
                exact = name in _PARTIAL_KEPT_EXACTLY
                assert mine["fell_back"] != exact, (name, mine)
                if exact:
                    assert mine["comm"] == {}, (name, mine)
                continue
            assert not mine["fell_back"], (name, mine)
            if name in _COPY_WHERE_TORCH_RAISES:
                assert mine["comm"] == {"reduce_scatter": 1}, mine
                continue
            assert mine["layout"] == torch_result["layout"], (name, mine, torch_result)
            want_comm = dict(torch_result["comm"])
            if name in _ALL_TO_ALL_INSTEAD_OF_ALL_GATHER:  # README: S(i) -> S(j) is one all-to-all
                want_comm.pop("all_gather")
                want_comm["all_to_all"] = 1
            assert mine["comm"] == want_comm, (name, mine["comm"], torch_result["comm"])


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 4))


def _load_state_dict_keeps_placements(world_size: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,))
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    problems = []
    for model_dim, state_dim in ((1, 0), (0, 1), (0, 0)):
        model = _Linear()
        model.weight = torch.nn.Parameter(
            distribute_tensor(torch.zeros(6, 4), mesh, [Shard(model_dim)])
        )
        before = model.weight
        state = {"weight": distribute_tensor(weight, mesh, [Shard(state_dim)])}
        model.load_state_dict(state)
        loaded = model.weight
        assert isinstance(loaded, DTensor)
        if loaded.placements != (Shard(model_dim),) or loaded is not before:
            problems.append(f"rowwise<-colwise {model_dim}<-{state_dim}: {loaded.placements}")
        if not torch.equal(loaded.full_tensor(), weight):
            problems.append(f"{model_dim}<-{state_dim}: wrong values")
    model = _Linear()
    model.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()]))
    model.load_state_dict({"weight": weight})  # plain full tensors: each rank copies its part
    loaded = model.weight
    assert isinstance(loaded, DTensor)
    if loaded.placements != (Replicate(),) or not torch.equal(loaded.full_tensor(), weight):
        problems.append(f"plain -> Replicate: {loaded.placements}")
    return problems


@world_sizes(2, 4)
def test_load_state_dict_keeps_each_parameters_placements(world_size: int) -> None:
    for problems in run_on_ranks(_load_state_dict_keeps_placements, world_size, world_size):
        assert problems == []

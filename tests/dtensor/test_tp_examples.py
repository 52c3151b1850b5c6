"""torch's tensor-parallel examples give torch DTensor's numbers and collectives on hp-dtensor.

Each example (an MLP, a Transformer block with attention, a Llama-style model with
sequence and loss parallel, the Llama on a 2-D (dp, tp) mesh) is one program in
``_tp_examples``, run once with torch's ``torch.distributed.tensor.parallel`` and once
with ``hyper_parallel.dtensor.parallel`` on the same seed and inputs. Oracle: torch's
run. Asserted: the loss, every gradient, the parameters after an AdamW step given
identical gradients, and the collectives of the step counted by each side's
CommDebugMode.

One deliberate difference shows in the counts: both sides leave the gradient of a
replicated weight used on sequence-sharded activations (the SequenceParallel norms)
Partial, with no collective in the backward; torch's optimizer all-reduces it in every
foreach op that reads it, hp's step reduces all of them once, in one flat all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale
from tests.dtensor._tp_examples import (
    HP,
    MLP,
    TORCH,
    Api,
    Llama,
    TransformerBlock,
    collective_counts,
    llama_plan,
    mlp_plan,
    transformer_block_plan,
)
from torch import nn

BATCH, SEQ, VOCAB = 4, 8, 32


def _full(t: torch.Tensor) -> torch.Tensor:
    """A (torch or hp) DTensor or plain tensor as a full plain tensor."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _mlp_loss(model: nn.Module, api: Api, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out: torch.Tensor = model(data["x"])
    return (out * data["w"]).sum()


def _block_loss(model: nn.Module, api: Api, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out: torch.Tensor = model(data["x"])
    return (out * data["w"]).sum()


def _llama_loss(model: nn.Module, api: Api, data: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(data["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(0, 1))


EXAMPLES: dict[str, tuple[Callable[[], nn.Module], Callable[[Api], Any], Callable[..., Any]]] = {
    "mlp": (MLP, mlp_plan, _mlp_loss),
    "transformer_block": (TransformerBlock, transformer_block_plan, _block_loss),
    "llama_sp_loss_parallel": (Llama, llama_plan, _llama_loss),
}


def _data(example: str, dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """The same inputs on every rank of a dp group; each dp group its own slice of the batch."""
    gen = torch.Generator().manual_seed(7)
    if example == "mlp":
        data = {"x": torch.randn(BATCH * dp_size, 10, generator=gen)}
        data["w"] = torch.randn(BATCH * dp_size, 6, generator=gen)
    elif example == "transformer_block":
        data = {"x": torch.randn(BATCH * dp_size, SEQ, 16, generator=gen)}
        data["w"] = torch.randn(BATCH * dp_size, SEQ, 16, generator=gen)
    else:
        data = {"tokens": torch.randint(0, VOCAB, (BATCH * dp_size, SEQ), generator=gen)}
        data["labels"] = torch.randint(0, VOCAB, (BATCH * dp_size, SEQ), generator=gen)
    return {k: v.chunk(dp_size)[dp_rank].contiguous() for k, v in data.items()}


def _step(
    api: Api,
    example: str,
    dp: bool,
    given_grads: dict[str, torch.Tensor] | None,
) -> dict[str, Any]:
    """One training step of ``example`` with ``api``; the full loss, gradients and parameters."""
    build, plan, loss_fn = EXAMPLES[example]
    world = dist.get_world_size()
    dtensor = api.dtensor
    if dp:
        mesh = dtensor.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
        dp_rank, dp_size = mesh.get_local_rank("dp"), 2
    else:
        tp_mesh = dtensor.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        dp_group, dp_rank, dp_size = None, 0, 1
    torch.manual_seed(0)
    model = build()
    api.parallel.parallelize_module(model, tp_mesh, plan(api))
    data = _data(example, dp_rank, dp_size)
    # torch's foreach kernels refuse lists mixing DTensors and plain tensors (the block's
    # norms stay plain): those examples step parameter by parameter.
    foreach = all(hasattr(p, "placements") for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)

    with api.comm_debug_mode() as comm:
        if example.startswith("llama"):
            with api.parallel.loss_parallel():
                loss = loss_fn(model, api, data)
                loss.backward()
        else:
            loss = loss_fn(model, api, data)
            loss.backward()
    fwd_bwd = collective_counts(comm)
    if dp_group is not None:  # data parallel: average the gradients over the dp axis
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(local, group=dp_group)
                local.div_(dp_size)
    grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    partial_grads = sorted(
        name
        for name, p in model.named_parameters()
        if any(pl.is_partial() for pl in getattr(p.grad, "placements", ()))
    )
    grad_placements = {  # as backward left them (hp's step reduces its Partial ones in place)
        name: tuple(getattr(p.grad, "placements", ())) for name, p in model.named_parameters()
    }
    if given_grads is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                assert p.grad is not None
                if name in partial_grads:  # the given sum, held by the mesh's first rank
                    grad: Any = p.grad
                    given = given_grads[name].clone()
                    first = grad.device_mesh.get_local_rank() == 0
                    local = given if first else torch.zeros_like(given)
                    p.grad = dtensor.DTensor.from_local(local, grad.device_mesh, grad.placements)
                else:  # hp: a full tensor is copied as this rank's slice
                    p.grad.copy_(given_grads[name])
    with api.comm_debug_mode() as comm:
        optimizer.step()
    return {
        "loss": _full(loss),
        "grads": grads,
        "partial_grads": partial_grads,
        "params": {name: _full(p) for name, p in model.named_parameters()},
        "param_placements": {
            name: tuple(getattr(p, "placements", ())) for name, p in model.named_parameters()
        },
        "grad_placements": grad_placements,
        "fwd_bwd": fwd_bwd,
        "optimizer": collective_counts(comm),
    }


def _both_sides(example: str, dp: bool) -> dict[str, dict[str, Any]]:
    torch_side = _step(TORCH, example, dp, None)
    hp_side = _step(HP, example, dp, torch_side["grads"])
    return {"torch": torch_side, "hp": hp_side}


def _layout(placement: Any) -> tuple[Any, ...]:
    """A (torch or hp) placement as plain values."""
    if placement.is_shard():
        return ("Shard", placement.dim)
    return ("Partial",) if placement.is_partial() else ("Replicate",)


def _check(results: list[dict[str, dict[str, Any]]]) -> None:
    for rank, sides in enumerate(results):
        want, got = sides["torch"], sides["hp"]
        where = f"rank {rank}"
        assert_close_to_scale(got["loss"], want["loss"], rel=1e-5, what=f"{where}: loss")
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert_close_to_scale(got["grads"][name], g, what=f"{where}: grad of {name}")
        for name, p in want["params"].items():
            assert_close_to_scale(got["params"][name], p, rel=1e-6, what=f"{where}: {name} stepped")
        # Parameters laid out as torch lays them out; hp's gradients laid out like their
        # parameters, except the Partial ones torch keeps (torch's may also be Replicate
        # for a Shard(0) embedding, which hp slices)
        for name, placements in want["param_placements"].items():
            expected = tuple(_layout(pl) for pl in placements)
            found = tuple(_layout(pl) for pl in got["param_placements"][name])
            assert found == expected, f"{where}: {name}: {found}, torch {placements}"
            if name in want["partial_grads"]:
                expected = tuple(_layout(pl) for pl in want["grad_placements"][name])
            found = tuple(_layout(pl) for pl in got["grad_placements"][name])
            assert found == expected, f"{where}: grad of {name}: {found}, expected {expected}"
        # Collectives: equal in forward and backward; the step reduces the Partial
        # gradients in one flat all-reduce, where torch all-reduces them op by op.
        assert got["partial_grads"] == want["partial_grads"], where
        assert got["fwd_bwd"] == want["fwd_bwd"], (
            f"{where}: hp {got['fwd_bwd']}, torch {want['fwd_bwd']}"
        )
        flat = {"all_reduce": 1} if want["partial_grads"] else {}
        assert got["optimizer"] == flat, f"{where}: hp's step {got['optimizer']}"
        assert want["optimizer"].get("all_reduce", 0) >= len(want["partial_grads"]), where
        assert set(want["optimizer"]) <= {"all_reduce"}
        assert bool(want["optimizer"]) == bool(want["partial_grads"])


@pytest.mark.parametrize("example", list(EXAMPLES))
@world_sizes(2, 4)
def test_torch_tp_example_on_hp_matches_torch(example: str, world_size: int) -> None:
    results = run_on_ranks(_both_sides, world_size, example, False, timeout_s=240)
    _check(results)


@world_sizes(4)
def test_torch_tp_llama_on_2d_dp_tp_mesh_matches_torch(world_size: int) -> None:
    results = run_on_ranks(_both_sides, world_size, "llama_sp_loss_parallel", True, timeout_s=240)
    _check(results)

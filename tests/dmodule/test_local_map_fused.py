"""The local_map boundary: one autograd node in, one out, the states' views (one node for
all of a module's states) kept per step.

Oracles: the same block on one device (values, gradients, SGD steps), and the unfused
composition of ``prepare_inputs`` / ``local_states`` / ``finish_outputs`` (the same
collectives, in the same order with the same sizes, and the same gradients bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import LocalMapConfig, MeshAxisName, Module, ShardingConfig
from hyper_parallel.dmodule._forward import ForwardPlan
from hyper_parallel.dmodule.local_map import local_states
from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

TP = MeshAxisName.TP
TIMEOUT_S = 240.0


def small_normal(tensor: torch.Tensor) -> torch.Tensor:
    """Weights small enough that three SGD steps stay finite."""
    return torch.nn.init.normal_(tensor, std=0.3)


class Mlp(Module):
    """Column-then-row MLP on local tensors, scaled by a tensor it reads from outside its states."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 8
        hidden: int = 16
        param_init = {  # noqa: RUF012 - a Config field
            "w1": small_normal,
            "w2": small_normal,
        }

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(config.hidden, config.dim))
        self.w2 = torch.nn.Parameter(torch.empty(config.dim, config.hidden))
        self.outside: torch.Tensor | None = None  # not a state: a plain attribute

    def forward(self, x: torch.Tensor, *, gain: float = 1.0) -> dict[str, torch.Tensor]:
        h = F.silu(F.linear(x, self.w1))
        if self.outside is not None:
            h = h * self.outside
        return {"y": F.linear(h, self.w2) * gain, "h": h}


def mlp_sharding() -> ShardingConfig:
    out_src: dict[str, Any] = {"y": {TP: Partial()}, "h": {TP: Shard(-1)}}
    return ShardingConfig(
        state_shardings={"w1": {TP: Shard(0)}, "w2": {TP: Shard(1)}},
        in_dst_shardings={"x": {TP: Replicate()}},
        out_src_shardings=out_src,
        out_dst_shardings={"y": {TP: Replicate()}, "h": None},
        local_map=LocalMapConfig(in_grad_placements={"x": {TP: Partial()}}),
    )


def _unfused(
    self: ForwardPlan, module: Any, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    args, kwargs = self.prepare_inputs(args, kwargs)
    with local_states(module):
        outputs = forward(module, *args, **kwargs)
    return self.finish_outputs(outputs)


def _node_names(root: Any) -> list[tuple[str, int]]:
    """``(class name, id)`` of every autograd node reachable from ``root``."""
    seen: dict[int, str] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = type(node).__name__
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return [(name, key) for key, name in seen.items()]


def _loss(block: Module, x: torch.Tensor, outside: torch.Tensor) -> Any:
    block.outside = outside
    first = block(x)
    second = block(first["y"], gain=0.5)  # the same states twice in one step
    return first, second


def _fused_boundary(world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    reference = Mlp.Config().build()
    reference.init_states()
    blocks = {}
    for kind in ("fused", "unfused"):
        block = Mlp.Config(sharding_config=mlp_sharding()).build()
        block.load_state_dict(reference.state_dict())
        block.parallelize(mesh)
        blocks[kind] = block
    torch.manual_seed(1)
    x_full = torch.randn(3, 8)
    outside_full = torch.rand(16) + 0.5

    # -- the autograd graph of one step: one node in and one out per call; the states'
    #    views (one node for both parameters) shared by both calls
    block = blocks["fused"]
    x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
    outside = outside_full.chunk(world_size)[mesh.get_local_rank("tp")].clone().requires_grad_()
    first, second = _loss(block, x, outside)
    names = [name for name, _ in _node_names(second["y"].grad_fn)]
    out["enter_nodes"] = names.count("_EnterLocalBackward")
    out["exit_nodes"] = names.count("_ExitLocalBackward")
    out["to_local_nodes"] = names.count("ToLocalBackward")
    out["states_nodes"] = names.count("_StatesLocalBackward")

    # -- values, gradients and three SGD steps against one device; collectives and
    #    gradients against the unfused path
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opts = {k: torch.optim.SGD(b.parameters(), lr=0.05) for k, b in blocks.items()}
    ref_outside = outside_full.clone().requires_grad_()
    records: dict[str, list[list[tuple[str, int]]]] = {"fused": [], "unfused": []}
    grads: dict[str, list[dict[str, torch.Tensor]]] = {"fused": [], "unfused": []}
    for step in range(3):
        reference.outside = ref_outside
        x_ref = x_full.clone().requires_grad_()
        ref_first = reference(x_ref)
        ref_second = reference(ref_first["y"], gain=0.5)
        ref_loss = (ref_second["y"] ** 2).sum() + (ref_first["h"] * ref_second["h"]).sum()
        ref_opt.zero_grad()
        ref_outside.grad = None
        ref_loss.backward()
        for kind, block in blocks.items():
            original = ForwardPlan.call_local
            if kind == "unfused":
                ForwardPlan.call_local = _unfused  # type: ignore[method-assign]
            try:
                x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
                outside = (
                    outside_full.chunk(world_size)[mesh.get_local_rank("tp")]
                    .clone()
                    .requires_grad_()
                )
                opts[kind].zero_grad()
                with CommDebugMode() as comm:
                    first, second = _loss(block, x, outside)
                    loss = (second["y"].to_local() ** 2).sum() + (
                        first["h"] * second["h"]
                    ).full_tensor().sum()
                    loss.backward()
            finally:
                ForwardPlan.call_local = original  # type: ignore[method-assign]
            records[kind].append([(r.kind, r.nbytes) for r in comm.records()])
            assert isinstance(x.grad, DTensor) and outside.grad is not None
            got = {"x": x.grad.full_tensor(), "outside": outside.grad.clone()}
            for name in ("w1", "w2"):
                p = block.get_parameter(name)
                assert isinstance(p.grad, DTensor)
                got[name] = p.grad.full_tensor()
                out[f"{kind}.{name}.grad_placements"] = p.grad.placements
            grads[kind].append(got)
            if kind == "fused":
                assert torch.isfinite(loss.detach()), f"step {step}: loss {loss} ref {ref_loss}"
                assert_close_to_scale(loss.detach(), ref_loss.detach(), what=f"loss {step}")
                assert ref_outside.grad is not None
                want = {
                    "x": x_ref.grad,
                    "outside": ref_outside.grad.chunk(world_size)[mesh.get_local_rank("tp")],
                    "w1": reference.w1.grad,
                    "w2": reference.w2.grad,
                }
                for name, value in want.items():
                    assert value is not None
                    assert_close_to_scale(got[name], value, what=f"{name} grad, step {step}")
            opts[kind].step()
        ref_opt.step()
        for name in ("w1", "w2"):
            assert_close_to_scale(
                blocks["fused"].get_parameter(name).full_tensor(),
                reference.get_parameter(name).detach(),
                what=f"{name} after step {step}",
            )
    out["same_collectives"] = records["fused"] == records["unfused"]
    out["collectives"] = records["fused"][0]
    out["diffs"] = [
        {name: float((f[name] - u[name]).abs().max()) for name in f}
        for f, u in zip(grads["fused"], grads["unfused"], strict=True)
    ]
    out["bitwise_same_grads"] = all(
        torch.equal(f[name], u[name])
        for f, u in zip(grads["fused"], grads["unfused"], strict=True)
        for name in f
    )

    # -- a state swapped in place (torch.utils.swap_tensors keeps the object, changes the
    #    shard): the kept view must not be reused
    block = blocks["fused"]
    x = distribute_tensor(x_full, mesh, [Replicate()])
    block.outside = None
    before = block(x)["y"].full_tensor().detach()
    w1 = block.get_parameter("w1")
    doubled = torch.nn.Parameter(DTensor.from_local(w1.to_local().detach() * 2, mesh, [Shard(0)]))
    torch.utils.swap_tensors(w1, doubled)  # type: ignore[no-untyped-call]
    after = block(x)["y"].full_tensor().detach()
    with torch.no_grad():
        expected = block(x)["y"].full_tensor()  # the unfused path (no autograd)
    out["swap_seen"] = not torch.equal(before, after) and torch.equal(after, expected)

    # -- under torch's activation checkpointing (non-reentrant): the recompute reuses the
    #    kept views and gives the same gradients bit for bit
    def run(checkpointed: bool) -> dict[str, torch.Tensor]:
        x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
        for p in block.parameters():
            p.grad = None

        def body(value: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = block(value)["y"]
            return y

        if checkpointed:
            y = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
        else:
            y = body(x)
        assert isinstance(y, DTensor)
        torch.autograd.backward((y.to_local() ** 2).sum())
        assert isinstance(x.grad, DTensor)
        grads = {"x": x.grad.to_local()}
        for name in ("w1", "w2"):
            grad = block.get_parameter(name).grad
            assert isinstance(grad, DTensor)
            grads[name] = grad.to_local()
        return grads

    plain, checkpointed = run(False), run(True)
    out["checkpoint_same"] = all(torch.equal(plain[k], checkpointed[k]) for k in plain)

    # -- a frozen state among trainable ones (the states' views are one node): it gets no
    #    gradient and the others' are unchanged; unfreezing it re-takes the views
    def grads_with(frozen: bool) -> dict[str, torch.Tensor | None]:
        block.outside = None
        block.get_parameter("w2").requires_grad_(not frozen)
        for p in block.parameters():
            p.grad = None
        x = distribute_tensor(x_full, mesh, [Replicate()])
        (block(x)["y"].to_local() ** 2).sum().backward()
        grads: dict[str, torch.Tensor | None] = {}
        for name in ("w1", "w2"):
            grad = block.get_parameter(name).grad
            grads[name] = None if grad is None else grad.full_tensor()
        return grads

    frozen, unfrozen = grads_with(True), grads_with(False)
    out["frozen_has_no_grad"] = frozen["w2"] is None
    out["unfrozen_has_grad"] = unfrozen["w2"] is not None
    w1_frozen, w1_unfrozen = frozen["w1"], unfrozen["w1"]
    out["others_unchanged"] = (
        w1_frozen is not None and w1_unfrozen is not None and torch.equal(w1_frozen, w1_unfrozen)
    )
    return out


def test_local_map_boundary_is_one_node_each_way_and_matches_one_device_and_unfused() -> None:
    for result in run_on_ranks(_fused_boundary, 2, 2, timeout_s=TIMEOUT_S):
        assert result["enter_nodes"] == 2 and result["exit_nodes"] == 2, result
        assert result["to_local_nodes"] == 0, result
        assert result["states_nodes"] == 1, result  # w1 and w2: one node, once for both calls
        assert result["same_collectives"], result["collectives"]
        # forward: y's all-reduce per call; backward: y's input-gradient all-reduce per call
        # (x's, and the first call's output feeding the second); h stays sharded
        kinds = [kind for kind, _ in result["collectives"]]
        assert kinds.count("all_reduce") >= 4, kinds
        assert result["bitwise_same_grads"], result["diffs"]
        assert result["fused.w1.grad_placements"] == (Shard(0),)
        assert result["fused.w2.grad_placements"] == (Shard(1),)
        assert result["swap_seen"]
        assert result["checkpoint_same"]
        assert result["frozen_has_no_grad"] and result["unfrozen_has_grad"], result
        assert result["others_unchanged"], result


def test_boundary_reduces_locally_only_partial_to_replicate() -> None:
    from hyper_parallel.dmodule.local_map import reduce_moves

    # the boundary's own all-reduce path covers exactly the moves redistribute makes with
    # all-reduces alone; anything else goes through redistribute (the unfused oracle above)
    assert reduce_moves((Partial(),), (Replicate(),)) == [(0, "sum")]
    assert reduce_moves((Partial("avg"), Shard(1)), (Replicate(), Shard(1))) == [(0, "avg")]
    assert reduce_moves((Replicate(), Partial("max")), (Replicate(), Replicate())) == [(1, "max")]
    assert reduce_moves((Shard(0),), (Shard(0),)) == []
    for src, dst in [
        ((Shard(0),), (Replicate(),)),  # all-gather
        ((Partial(),), (Shard(0),)),  # reduce-scatter
        ((Replicate(),), (Shard(0),)),  # local slice
        ((Shard(0),), (Shard(1),)),  # all-to-all
        ((Replicate(),), (Partial(),)),
    ]:
        assert reduce_moves(src, dst) is None, (src, dst)

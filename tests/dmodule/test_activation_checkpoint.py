"""Activation checkpointing: losses and gradients bitwise those of no checkpointing (dropout too)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dtensor._tp_examples import collective_counts
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.dmodule.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint,
    checkpoint_mode,
    is_checkpointed,
    save_matmuls,
)
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama
from hyper_parallel.dtensor import DTensor, init_device_mesh
from hyper_parallel.dtensor.collectives import observe_collectives
from hyper_parallel.dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

MODES = ("full", "selective")


class _DropoutMLP(nn.Module):
    """w2(dropout(gelu(w1(x)))): dropout draws a mask the recompute must replay."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.dropout(F.gelu(self.w1(x)), p=0.5, training=True))
        return out


def _tiny_llama(local_map: bool = False) -> Llama.Config:
    return Llama.Config(
        vocab_size=32,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=32,
        max_seq_len=8,
        use_local_map=local_map,
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(
    model: nn.Module, run: Any, seed: int, backward_collectives: list[Any] | None = None
) -> list[torch.Tensor]:
    """The loss and every parameter's gradient (full tensors) of one forward/backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = run(model)
    with observe_collectives(
        (backward_collectives if backward_collectives is not None else []).append
    ):
        loss.backward()
    grads = [_full(p.grad) for p in model.parameters() if p.grad is not None]
    return [_full(loss).detach(), *grads]


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"{what}: tensor {index} differs by {(g - w).abs().max()}"


def _mlp_loss(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(torch.randn(4, 8)).square().mean()
    return out


def _llama_loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 32, (2, 8))
    return model.loss(tokens[:, :-1], tokens[:, 1:])  # type: ignore[no-any-return,operator]


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_blocks_match_no_checkpointing_bitwise_one_process(mode: str) -> None:
    torch.manual_seed(0)
    mlps = nn.ModuleList([_DropoutMLP(), _DropoutMLP()])
    model = nn.Sequential(*mlps)
    want = _step(model, _mlp_loss, seed=1)
    apply_activation_checkpointing(mlps, mode=mode)
    assert all(is_checkpointed(m) for m in mlps)
    _assert_bitwise(_step(model, _mlp_loss, seed=1), want, f"dropout MLP, {mode}")
    # the dropout mask is drawn, not constant: another seed gives another loss
    assert not torch.equal(_step(model, _mlp_loss, seed=2)[0], want[0])

    torch.manual_seed(0)
    llama = _tiny_llama().build()
    llama.init_weights()
    want = _step(llama, _llama_loss, seed=3)
    apply_activation_checkpointing(llama.layers, mode=mode)
    _assert_bitwise(_step(llama, _llama_loss, seed=3), want, f"llama-ref, {mode}")


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten ops that run (by overload packet name), e.g. during a backward."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_selective_policy_recomputes_pointwise_ops_and_keeps_matmul_outputs() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(t)) * 2

    want = torch.autograd.grad(block(x).sum(), (x, layer.weight))
    ran: dict[str, dict[str, int]] = {}
    for name, policy in (("full", None), ("selective", save_matmuls)):
        loss = checkpoint(block, x, policy_fn=policy).sum()
        with _OpCounter() as counter:
            got = torch.autograd.grad(loss, (x, layer.weight))
        _assert_bitwise(list(got), list(want), f"checkpoint, {name}")
        ran[name] = counter.counts
    # both recompute tanh in backward; only full recomputes the matmul (addmm)
    assert ran["full"].get("tanh", 0) == ran["selective"].get("tanh", 0) == 1, ran
    assert ran["full"].get("addmm", 0) == 1, ran
    assert ran["selective"].get("addmm", 0) == 0, ran


def test_bad_activation_checkpointing_arguments_are_refused_before_any_change() -> None:
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"expected mode to be one of .* found 'ful'"):
        apply_activation_checkpointing(blocks, mode="ful")
    with pytest.raises(ValueError, match="policy_fn is for mode='selective'"):
        apply_activation_checkpointing(blocks, mode="full", policy_fn=save_matmuls)
    apply_activation_checkpointing(blocks[1], mode="full")
    with pytest.raises(ValueError, match=r"block 1 \(Linear\) is already checkpointed"):
        apply_activation_checkpointing(blocks, mode="full")
    assert not is_checkpointed(blocks[0])  # validated before changing block 0
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        checkpoint(torch.relu, torch.ones(1), use_reentrant=True)
    with pytest.raises(ValueError, match=r"activation_checkpoint.mode: expected one of"):
        checkpoint_mode({"activation_checkpoint": "everything"})
    assert checkpoint_mode({"activation_checkpoint": "full"}) == "full"


def _tp_parity() -> dict[str, bool]:
    """On each rank: TP llama-ref (DTensor and local_map) and a TP dropout MLP, with and without AC."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    found: dict[str, bool] = {}
    for local_map in (False, True):
        torch.manual_seed(0)
        base = _tiny_llama(local_map).build()
        base.init_weights()
        plain: list[Any] = []
        want = _step(parallelize_llama(copy.deepcopy(base), mesh), _llama_loss, 5, plain)
        for mode in MODES:
            model = parallelize_llama(
                copy.deepcopy(base), mesh, {"activation_checkpoint": {"mode": mode}}
            )
            assert all(is_checkpointed(block) for block in model.layers)
            recomputed: list[Any] = []
            got = _step(model, _llama_loss, 5, recomputed)
            found[f"llama local_map={local_map} {mode}"] = all(
                torch.equal(g, w) for g, w in zip(got, want, strict=True)
            )
            if mode == "full":  # the recompute re-issues the blocks' forward collectives
                found[f"llama local_map={local_map} recomputed"] = len(recomputed) > len(plain)
    # dropout on a sharded DTensor (the hidden activations, Shard(-1)): hp-dtensor's
    # random op reads torch's generator, which the checkpoint replays in the recompute
    torch.manual_seed(0)
    base_mlp = _DropoutMLP()
    plan: dict[str, ParallelStyle] = {
        "w1": ColwiseParallel(use_local_output=False),
        "w2": RowwiseParallel(),
    }
    want = _step(parallelize_module(copy.deepcopy(base_mlp), mesh, plan), _mlp_loss, seed=6)
    for mode in MODES:
        mlp = parallelize_module(copy.deepcopy(base_mlp), mesh, plan)
        apply_activation_checkpointing(mlp, mode=mode)
        got = _step(mlp, _mlp_loss, seed=6)
        found[f"dropout MLP {mode}"] = all(
            torch.equal(g, w) for g, w in zip(got, want, strict=True)
        )
    return found


def _fsdp_groups(model: Any, fully_shard: Any, mesh: Any) -> None:
    """``apply_fsdp``'s groups (embedding, each block, norm + output, root) with ``fully_shard``."""
    fully_shard(model.tok_embeddings, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.output], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _fsdp_step(model: Any, comm_mode: Any, rows: slice) -> dict[str, Any]:
    """One forward/backward on ``rows`` of the batch: loss, full gradients, collectives."""
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(9))
    with comm_mode() as comm:
        loss = model.loss(tokens[rows, :-1], tokens[rows, 1:])
        loss.backward()
    # torch's DTensors (torch FSDP2) have full_tensor too
    grads = [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in model.parameters()
    ]
    return {"tensors": [_full(loss).detach(), *grads], "counts": collective_counts(comm)}


def _fsdp_parity() -> dict[str, Any]:
    """llama-ref on dp_shard=2 with and without AC (hp and torch's FSDP2), and one process."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from hyper_parallel.dtensor import CommDebugMode

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    base = _tiny_llama().build()
    base.init_weights()
    dp = torch.distributed.get_rank()
    rows = slice(2 * dp, 2 * dp + 2)
    out: dict[str, Any] = {
        "one_process": _fsdp_step(copy.deepcopy(base), CommDebugMode, slice(0, 4))
    }
    for mode in ("none", *MODES):
        job = {"activation_checkpoint": mode} if mode != "none" else None
        hp_model = parallelize_llama(copy.deepcopy(base), mesh, job)
        assert all(is_checkpointed(block) == (mode != "none") for block in hp_model.layers)
        out[f"hp {mode}"] = _fsdp_step(hp_model, CommDebugMode, rows)
        torch_model = copy.deepcopy(base)
        if mode != "none":
            apply_activation_checkpointing(torch_model.layers, mode=mode)
        _fsdp_groups(torch_model, torch_fsdp.fully_shard, torch_mesh("cpu", (2,)))
        out[f"torch {mode}"] = _fsdp_step(torch_model, TorchCommDebugMode, rows)
    # the losses of the two ranks' halves, averaged: the full batch's mean loss
    for key, found in out.items():
        if key != "one_process":
            loss = found["tensors"][0].clone()
            torch.distributed.all_reduce(loss)
            found["mean_loss"] = loss / 2
    return out


def _two_rank_cases() -> dict[str, Any]:
    return {"tp": _tp_parity(), "fsdp": _fsdp_parity()}


def test_checkpointing_under_tp_and_fsdp_matches_no_checkpointing_on_2_ranks() -> None:
    for rank, found in enumerate(run_on_ranks(_two_rank_cases, 2, timeout_s=300)):
        assert all(found["tp"].values()), f"rank {rank}: {found['tp']}"
        fsdp = found["fsdp"]
        want = fsdp["hp none"]
        for mode in MODES:
            # bitwise: the same ranks, layout and batch rows as without checkpointing
            _assert_bitwise(fsdp[f"hp {mode}"]["tensors"], want["tensors"], f"FSDP, AC {mode}")
        # FSDP's all-gathers and reduce-scatters per step are those without AC, and
        # torch's FSDP2 + torch.utils.checkpoint on the same model and groups issue as many
        # (the recompute runs inside the block, after FSDP's pre-backward unshard)
        counts = {key: fsdp[key]["counts"] for key in fsdp if key != "one_process"}
        assert all(c == want["counts"] for c in counts.values()), counts
        # 4 groups with parameters (embedding, 2 blocks, norm + output; the root has none
        # left) all-gather in forward, are resharded after it and all-gather again in
        # backward, once each, with or without AC; each reduce-scatters its gradients once
        assert want["counts"] == {"all_gather": 8, "reduce_scatter": 4}, want["counts"]
        # one process on the whole batch: the mean loss, and FSDP's averaged gradients
        one = fsdp["one_process"]["tensors"]
        assert_close_to_scale(want["mean_loss"], one[0], what="loss vs one process")
        for index, (got, ref) in enumerate(zip(want["tensors"][1:], one[1:], strict=True)):
            assert_close_to_scale(got, ref, what=f"gradient {index} vs one process")

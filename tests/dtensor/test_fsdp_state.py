"""FSDP state on 4 ranks: clip_grad_norm_ across meshes, DCP resharding, the meta-device flow.

Oracles: one process holding the full model (torch's ``clip_grad_norm_``, a one-device
init with the same seed), the saved model's full tensors (a checkpoint loaded onto any
other layout gives them back), and torch's FSDP2 + TP checkpoints (loaded into hp's
FSDP x TP model and back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dtensor import _fsdp_cases as cases
from tests.dtensor._tp_examples import HP, TORCH, Api
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import hyper_parallel.dtensor as hp_dt
import hyper_parallel.dtensor.fsdp as hp_fsdp


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = full.detach().clone()
    return out


def _stepped(api: Api, shape: tuple[int, ...], mode: str, seed: int) -> nn.Module:
    """A model sharded as ``mode`` with values no init gives (one AdamW step)."""
    torch.manual_seed(seed)
    model = cases.Model()
    if mode == "tp":
        mesh = api.dtensor.init_device_mesh("cpu", shape, mesh_dim_names=("tp",))
        tp = api.parallel
        for block in model.blocks:
            tp.parallelize_module(
                block, mesh, {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()}
            )
    else:
        cases.apply(api, model, shape, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = (t[0] for t in cases.global_batch())
    nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()
    return model


def _sequence_parallel_norm_under_fsdp() -> dict[str, Any]:
    """A LayerNorm under SequenceParallel on tp, fully sharded over dp: two AdamW steps.

    Its weight and bias are Replicate on tp, so their gradients are Partial on tp; FSDP
    reduce-scatters them over dp and all-reduces the chunks over tp after that. Returns the
    parameters after each step (hp and one process on the global batch) and the tp
    collectives of the first backward.
    """
    torch.manual_seed(11)
    norm = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    one = nn.LayerNorm(8)
    one.load_state_dict(norm.state_dict())
    mesh = hp_dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hp_dt.parallel.parallelize_module(
        norm, mesh["tp"], hp_dt.parallel.SequenceParallel(sequence_dim=0)
    )
    hp_fsdp.fully_shard(norm, mesh=mesh["dp"])
    opt = torch.optim.AdamW(norm.parameters(), lr=0.1)
    one_opt = torch.optim.AdamW(one.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(12)
    rows = slice(4 * mesh.get_local_rank("dp") + 2 * mesh.get_local_rank("tp"), None)
    out: dict[str, Any] = {"params": [], "one": []}
    for step in range(2):
        x, target = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        mine = hp_dt.DTensor.from_local(target[rows][:2], mesh["tp"], [hp_dt.Shard(0)])
        with hp_dt.CommDebugMode() as comm:
            (norm(x[rows][:2].clone()) * mine).sum().backward()  # type: ignore[no-untyped-call]
        if step == 0:
            out["tp"] = [(r.kind, r.nbytes) for r in comm.records() if r.mesh_axis == "tp"]
        opt.step()
        opt.zero_grad()
        ((one(x) * target).sum() / 2).backward()  # type: ignore[no-untyped-call]  # FSDP: dp mean
        one_opt.step()
        one_opt.zero_grad()
        out["params"].append(_full(norm))
        out["one"].append({n: p.detach().clone() for n, p in one.named_parameters()})
    return out


def _state_on_four_ranks(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    # clip_grad_norm_ over FSDP x TP gradients on three meshes (dp; (dp, tp); (tp, dp))
    torch.manual_seed(0)
    model = cases.Model()
    mesh = cases.apply(HP, model, (2, 2), "fsdp_tp")
    xs, ys = cases.global_batch()
    per = cases.BATCH // 2
    dp = mesh.get_local_rank("dp")
    loss = nn.functional.mse_loss(
        model(xs[0, dp * per : (dp + 1) * per]), ys[0, dp * per : (dp + 1) * per]
    )
    loss.backward()  # type: ignore[no-untyped-call]
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}  # type: ignore[attr-defined]
    out["clip_meshes"] = sorted(meshes)
    out["clip_total"] = hp_dt.clip_grad_norm_(model.parameters(), max_norm=0.05)
    grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters()}
    out["clipped"] = {n: g.full_tensor() for n, g in grads.items()}
    torch.manual_seed(0)
    one = cases.Model()
    nn.functional.mse_loss(one(xs[0]), ys[0]).backward()  # type: ignore[no-untyped-call]
    out["one_total"] = torch.nn.utils.clip_grad_norm_(one.parameters(), max_norm=0.05)
    out["one_clipped"] = {n: p.grad.clone() for n, p in one.named_parameters()}  # type: ignore[union-attr]

    # DCP: saved on dp=4, loaded on (dp=2, tp=2) and on tp=4 without FSDP
    saved = _stepped(HP, (4,), "fsdp", seed=1)
    out["saved"] = _full(saved)
    dcp_save(saved.state_dict(), checkpoint_id=f"{root}/fsdp4")
    for name, shape, mode in (("fsdp_tp", (2, 2), "fsdp_tp"), ("tp4", (4,), "tp")):
        target = _stepped(HP, shape, mode, seed=2)
        state = target.state_dict()
        dcp_load(state, checkpoint_id=f"{root}/fsdp4")
        target.load_state_dict(state)
        out[f"loaded_{name}"] = _full(target)

    # torch FSDP2 + TP checkpoint -> hp FSDP x TP, and hp's -> torch's
    torch_model = _stepped(TORCH, (2, 2), "fsdp_tp", seed=3)
    out["torch_saved"] = _full(torch_model)
    dcp_save(torch_model.state_dict(), checkpoint_id=f"{root}/torch")
    hp_model = _stepped(HP, (2, 2), "fsdp_tp", seed=4)
    state = hp_model.state_dict()
    dcp_load(state, checkpoint_id=f"{root}/torch")
    hp_model.load_state_dict(state)
    out["hp_from_torch"] = _full(hp_model)
    hp_saved = _stepped(HP, (2, 2), "fsdp_tp", seed=5)
    out["hp_saved"] = _full(hp_saved)
    dcp_save(hp_saved.state_dict(), checkpoint_id=f"{root}/hp")
    torch_target = _stepped(TORCH, (2, 2), "fsdp_tp", seed=6)
    state = torch_target.state_dict()
    dcp_load(state, checkpoint_id=f"{root}/hp")
    torch_target.load_state_dict(state)
    out["torch_from_hp"] = _full(torch_target)

    # meta -> TP -> fully_shard -> to_empty -> init: local shards only, one device's values
    with torch.device("meta"):
        meta = cases.Model()
    cases.apply(HP, meta, (2, 2), "fsdp_tp", src_data_rank=None)  # meta: nothing to scatter
    meta.to_empty(device="cpu")
    torch.manual_seed(9)
    for p in meta.parameters():
        nn.init.normal_(p)
    dense = cases.Model()
    torch.manual_seed(9)
    for p in dense.parameters():
        nn.init.normal_(p)
    out["meta_init"] = _full(meta)
    out["dense_init"] = _full(dense)
    out["meta_bytes"] = {
        n: (p.to_local().untyped_storage().nbytes(), p.to_local().numel() * 4)  # type: ignore[attr-defined]
        for n, p in meta.named_parameters()
    }
    # the initialised model trains: one more forward/backward runs without error
    meta(xs[0, :per]).sum().backward()
    out["sp_norm"] = _sequence_parallel_norm_under_fsdp()
    return out


def test_clip_dcp_resharding_torch_interop_and_meta_init_on_four_ranks(tmp_path: Path) -> None:
    for rank, got in enumerate(run_on_ranks(_state_on_four_ranks, 4, str(tmp_path), timeout_s=300)):
        what = f"rank {rank}"
        assert got["clip_meshes"] == [("dp",), ("dp", "tp")], what
        assert_close_to_scale(got["clip_total"], got["one_total"], what=f"{what} total norm")
        for n, g in got["one_clipped"].items():
            assert_close_to_scale(got["clipped"][n], g, what=f"{what} clipped {n}")
        for name in ("loaded_fsdp_tp", "loaded_tp4"):
            for n, p in got["saved"].items():
                assert torch.equal(got[name][n], p), (what, name, n)
        for loaded, saved in (("hp_from_torch", "torch_saved"), ("torch_from_hp", "hp_saved")):
            for n, p in got[saved].items():
                assert torch.equal(got[loaded][n], p), (what, loaded, n)
        for n, p in got["dense_init"].items():
            assert torch.equal(got["meta_init"][n], p), (what, "meta init", n)
        for n, (have, local) in got["meta_bytes"].items():
            assert have == local, (what, n, have, local)
        sp = got["sp_norm"]
        for step, (mine, one) in enumerate(zip(sp["params"], sp["one"], strict=True)):
            for n, p in one.items():
                assert_close_to_scale(mine[n], p, what=f"{what} SP norm {n}, step {step}")
        # one all-reduce over tp in the backward, of the dp chunks (4 of 8 values) of the
        # weight's and the bias's gradients together (not of the whole gradients, one each)
        assert sp["tp"] == [("all_reduce", 2 * 4 * 4)], (what, sp["tp"])

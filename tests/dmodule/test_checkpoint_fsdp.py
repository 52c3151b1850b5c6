"""llama-ref under FSDP x TP (``parallelize_llama`` on a (dp_shard, tp) mesh) and its state dicts.

Oracle: the same model, init and step in one process (loss, full state dicts through
torch's own ``get_state_dict``); a state dict loaded into a fresh FSDP model (full,
sharded, or broadcast from rank 0) gives the same full values back; ``load_hf`` of a
one-process model's transformers directory into a meta-built FSDP x TP model gives
its values, each rank holding only its shards.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dmodule._checkpoint_training import CONFIG
from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

from hyper_parallel.dmodule.checkpoint import (
    StateDictOptions,
    get_state_dict,
    load_hf,
    save_hf,
    set_state_dict,
)
from hyper_parallel.dmodule.models.llama import parallelize_llama
from hyper_parallel.dmodule.models.training import average_gradients, synthetic_batch
from hyper_parallel.dtensor import CommDebugMode, DTensor, init_device_mesh

FULL = StateDictOptions(full_state_dict=True)


def _flat(osd: dict[str, Any]) -> dict[str, Any]:
    return {f"{fqn}.{k}": v for fqn, states in osd["state"].items() for k, v in states.items()}


def _model(seed: int, mesh: Any) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = CONFIG.build()
    model.init_weights()
    if mesh is not None:
        parallelize_llama(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _step(model: Any, opt: torch.optim.Optimizer, rows: slice) -> float:
    tokens, targets = synthetic_batch(0, batch_size=4, seq_len=8, vocab_size=24, seed=1)
    loss = model.loss(tokens[rows], targets[rows])
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _fsdp_ranks(hf_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    # load_hf into a meta-built FSDP x TP model: each rank reads its slices
    with torch.device("meta"):
        hf_model = CONFIG.build()
    parallelize_llama(hf_model, mesh)
    hf_model.to_empty(device="cpu")
    load_hf(hf_model, hf_dir)
    hf_state: Any = hf_model.state_dict()
    hf_full = {k: v.full_tensor() for k, v in hf_state.items()}
    hf_local = {k: v.to_local().numel() for k, v in hf_state.items()}
    model, opt = _model(0, mesh)
    dp = mesh.get_local_rank("dp_shard")
    loss = _step(model, opt, slice(dp * 2, dp * 2 + 2))
    total = torch.tensor([loss])
    torch.distributed.all_reduce(total)
    out: dict[str, Any] = {"loss": float(total) / 4}  # 2 dp ranks x 2 tp ranks that agree
    out["hf_full"], out["hf_local"] = hf_full, hf_local
    out["placements"] = {n: tuple(map(str, p.placements)) for n, p in model.named_parameters()}
    try:  # mixing FSDP with replicated data parallelism on one model is refused
        average_gradients(model, mesh, "dp_shard")
    except ValueError as error:
        out["mixed"] = str(error)
    msd, osd = get_state_dict(model, opt, options=FULL)
    out["full_model"], out["full_optim"] = msd, _flat(osd)
    off_m, _ = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out["offloaded_keys"] = len(off_m)
    sharded_m, sharded_o = get_state_dict(model, opt)
    loads: Any = (
        (
            "full",
            lambda m, o: set_state_dict(
                m, o, model_state_dict=msd, optim_state_dict=osd, options=FULL
            ),
        ),
        (
            "sharded",
            lambda m, o: set_state_dict(
                m, o, model_state_dict=sharded_m, optim_state_dict=sharded_o
            ),
        ),
        (
            "rank0",
            lambda m, o: set_state_dict(
                m,
                o,
                model_state_dict=msd if torch.distributed.get_rank() == 0 else {},
                optim_state_dict=osd if torch.distributed.get_rank() == 0 else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            ),
        ),
    )
    for name, load in loads:
        fresh, fresh_opt = _model(7, mesh)
        _step(fresh, fresh_opt, slice(dp * 2, dp * 2 + 2))  # optimizer states exist
        load(fresh, fresh_opt)
        got_m, got_o = get_state_dict(fresh, fresh_opt, options=FULL)
        out[f"loaded_{name}"] = (got_m, _flat(got_o))
    # activation checkpointing on FSDP x TP: the step of no checkpointing, bitwise, and
    # FSDP's collectives unchanged (the recompute re-issues only TP's forward all-reduces)
    tokens, targets = synthetic_batch(0, batch_size=4, seq_len=8, vocab_size=24, seed=1)
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        ac_model = CONFIG.build()
        ac_model.init_weights()
        parallelize_llama(
            ac_model, mesh, {"activation_checkpoint": mode} if mode != "none" else None
        )
        with CommDebugMode() as comm:
            ac_loss = ac_model.loss(tokens[dp * 2 : dp * 2 + 2], targets[dp * 2 : dp * 2 + 2])
            ac_loss.backward()
        grads = [p.grad.full_tensor() for p in ac_model.parameters() if p.grad is not None]
        fsdp_counts = Counter(r.kind for r in comm.records() if r.mesh_axis == "dp_shard")
        loss_full = ac_loss.full_tensor() if isinstance(ac_loss, DTensor) else ac_loss
        out[f"ac_{mode}"] = ([loss_full.detach(), *grads], dict(fsdp_counts))
    return out


def test_fsdp_x_tp_llama_trains_as_one_process_and_its_state_dicts_round_trip(
    tmp_path: Path,
) -> None:
    torch.manual_seed(11)
    saved = CONFIG.build()
    saved.init_weights()
    save_hf(saved, tmp_path)
    saved_state = {k: v.detach().clone() for k, v in saved.state_dict().items()}
    model, opt = _model(0, None)
    loss = _step(model, opt, slice(0, 4))
    ref: Any = torch_get_state_dict(model, opt, options=TorchOptions(full_state_dict=True))
    msd, osd = ref
    ref_optim = _flat(osd)  # type: ignore[arg-type]
    for rank, got in enumerate(run_on_ranks(_fsdp_ranks, 4, str(tmp_path), timeout_s=300)):
        what = f"rank {rank}"
        for key, want in saved_state.items():
            assert torch.equal(got["hf_full"][key], want), (what, "load_hf", key)
            assert got["hf_local"][key] < want.numel(), (what, "a full tensor was read", key)
        assert abs(got["loss"] - loss) <= 1e-5 * abs(loss), (what, got["loss"], loss)
        # on (dp_shard, tp), as torch's fully_shard + TP: a Rowwise weight (Shard(0), Shard(1)),
        # a Colwise one (_StridedShard(0, sf=2), Shard(0)) (str: torch's "_S(0, 2)")
        assert got["placements"]["layers.0.attention.wo.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
        assert got["placements"]["layers.0.attention.wq.weight"] == ("_S(0, 2)", "Shard(dim=0)")
        for key, want in msd.items():
            assert_close_to_scale(got["full_model"][key], want, rel=1e-4, what=f"{what} {key}")
        for key, want in ref_optim.items():
            assert_close_to_scale(got["full_optim"][key], want, rel=1e-4, what=f"{what} {key}")
        assert "fully sharded" in got["mixed"] and "one data-parallel scheme" in got["mixed"]
        assert got["offloaded_keys"] == (len(msd) if rank == 0 else 0)
        for name in ("full", "sharded", "rank0"):
            got_m, got_o = got[f"loaded_{name}"]
            for key, want in got["full_model"].items():
                assert torch.equal(got_m[key], want), (what, name, key)
            for key, want in got["full_optim"].items():
                assert torch.equal(got_o[key], want), (what, name, key)
        want_ac, want_counts = got["ac_none"]
        assert want_counts["all_gather"] > 0 and want_counts["reduce_scatter"] > 0, want_counts
        for mode in ("full", "selective"):
            tensors, counts = got[f"ac_{mode}"]
            assert counts == want_counts, (what, mode, counts, want_counts)
            for index, (g, w) in enumerate(zip(tensors, want_ac, strict=True)):
                assert torch.equal(g, w), (what, mode, index)

"""get_state_dict / set_state_dict of a parallelized model with AdamW and SGD.

Oracle: the same model trained in one process, and torch's own
``get_state_dict`` of it (keys, optimizer-state names, values).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dmodule._checkpoint_training import build, train
from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

from hyper_parallel.dmodule.checkpoint import (
    StateDictOptions,
    TrainingState,
    get_state_dict,
    set_state_dict,
)
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import DTensor, distribute_tensor


def _flat_optim(osd: dict[str, Any]) -> dict[str, Any]:
    return {f"{fqn}.{k}": v for fqn, states in osd["state"].items() for k, v in states.items()}


def _state_dicts(dp: int, tp: int, optimizer: str) -> dict[str, Any]:
    """Train 2 steps; the sharded and full state dicts, and what torch's helper gives."""
    mesh, model, opt = build(dp, tp, seed=0, optimizer=optimizer)
    torch.manual_seed(5)
    train(mesh, model, opt, TrainingState(), 2)
    msd, osd = get_state_dict(model, opt)
    torch_msd, torch_osd = torch_get_state_dict(model, opt)  # torch's helper, as is
    layouts = {
        key: (value.placements, msd[key.rsplit(".", 1)[0]].placements)
        for key, value in _flat_optim(osd).items()
        if isinstance(value, DTensor)
    }
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    off_m, off_o = get_state_dict(model, opt, options=offload)
    if torch.distributed.get_rank() == 0:  # as torch: only rank 0 gets the offloaded values
        offloaded = all(torch.equal(off_m[k], v) for k, v in full_m.items()) and bool(off_o)
    else:
        offloaded = off_m == {} and off_o == {}
    return {
        "offloaded": offloaded,
        "model_keys": list(msd),
        "torch_model_keys": list(torch_msd),
        "optim_keys": sorted(_flat_optim(osd)),
        "torch_optim_keys": sorted(_flat_optim(torch_osd)),  # type: ignore[arg-type]
        "param_groups": (osd["param_groups"], torch_osd["param_groups"]),
        "model_is_dtensor": all(isinstance(v, DTensor) for v in msd.values()),
        "layouts": layouts,
        "full_model": full_m,
        "full_optim": _flat_optim(full_o),
        "full_plain": all(
            type(v) is torch.Tensor for v in [*full_m.values(), *_flat_optim(full_o).values()]
        ),
    }


def _one_process(optimizer: str) -> dict[str, Any]:
    mesh, model, opt = build(1, 0, seed=0, optimizer=optimizer)
    torch.manual_seed(5)
    train(mesh, model, opt, TrainingState(), 2)
    msd, osd = torch_get_state_dict(model, opt, options=TorchOptions(full_state_dict=True))
    return {"model": msd, "optim": _flat_optim(osd)}  # type: ignore[arg-type]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize(("world", "dp", "tp"), [(2, 1, 2), (4, 2, 2)], ids=["tp2", "dp2xtp2"])
def test_get_state_dict_is_fqn_keyed_sharded_like_params_and_gathers_like_one_process(
    optimizer: str, world: int, dp: int, tp: int
) -> None:
    ref = _one_process(optimizer)
    for found in run_on_ranks(_state_dicts, world, dp, tp, optimizer):
        assert found["model_keys"] == found["torch_model_keys"] == list(ref["model"])
        assert found["optim_keys"] == found["torch_optim_keys"] == sorted(ref["optim"])
        assert found["param_groups"][0] == found["param_groups"][1]
        assert found["model_is_dtensor"]
        assert found["layouts"], "no DTensor optimizer state"
        for key, (state_layout, param_layout) in found["layouts"].items():
            assert state_layout == param_layout, key
        assert found["full_plain"]
        assert found["offloaded"]
        for key, want in ref["model"].items():
            assert_close_to_scale(found["full_model"][key], want, rel=1e-4, what=key)
        for key, want in ref["optim"].items():
            assert_close_to_scale(found["full_optim"][key], want, rel=1e-4, what=key)


def _loaded_then_step(dp: int, tp: int, ref: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """Load the one-process state (full tensors) into a parallel model; loss, grads, one step.

    The step is taken from the one-process gradients (an optimizer step compared given
    identical gradients: AdamW turns float reordering in a tiny gradient into ~lr).
    """
    _, model, opt = build(dp, tp, seed=3)
    full = ref["full"]
    set_state_dict(
        model,
        opt,
        model_state_dict=full["model"],
        optim_state_dict=full["optim"],
        options=StateDictOptions(full_state_dict=True),
    )
    if sharded:  # and on through the sharded form into another model
        msd, osd = get_state_dict(model, opt)
        _, model, opt = build(dp, tp, seed=4)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    got_m, got_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    loaded = all(torch.equal(got_m[k], v) for k, v in full["model"].items()) and all(
        torch.equal(v, _flat_optim(full["optim"])[k]) for k, v in _flat_optim(got_o).items()
    )
    loss = model.loss(*ref["batch"])
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}  # type: ignore[union-attr]
    for k, p in model.named_parameters():
        assert isinstance(p, DTensor)
        p.grad = distribute_tensor(ref["grads"][k], p.device_mesh, p.placements, src_data_rank=None)
    opt.step()
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"loaded": loaded, "loss": loss.item(), "grads": grads, "params": params}


def _one_process_continued() -> dict[str, Any]:
    _, model, opt = build(1, 0, seed=0)
    torch.manual_seed(5)
    train(None, model, opt, TrainingState(), 2)
    msd, osd = torch_get_state_dict(model, opt, options=TorchOptions(full_state_dict=True))
    # torch's helper returns the optimizer's live tensors: copy before stepping on
    full = {"model": copy.deepcopy(msd), "optim": copy.deepcopy(osd)}
    batch = synthetic_batch(7, batch_size=4, seq_len=8, vocab_size=24)
    loss = model.loss(*batch)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}  # type: ignore[union-attr]
    opt.step()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    return {"full": full, "batch": batch, "loss": loss.item(), "grads": grads, "params": params}


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "full-then-sharded"])
def test_set_state_dict_loads_exactly_and_steps_like_one_process(sharded: bool) -> None:
    ref = _one_process_continued()
    for found in run_on_ranks(_loaded_then_step, 2, 1, 2, ref, sharded):
        assert found["loaded"], "set_state_dict did not load the values bit for bit"
        assert abs(found["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
        for key, want in ref["grads"].items():
            assert_close_to_scale(found["grads"][key], want, rel=1e-4, what=f"grad {key}")
        for key, want in ref["params"].items():
            assert_close_to_scale(found["params"][key], want, rel=1e-5, what=key)

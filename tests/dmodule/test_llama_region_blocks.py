"""llama-ref with ``region_blocks``: each block one outer ``local_map`` region, its norms,
attention and feed-forward inner regions, the residual stream plain local tensors.

Oracles: one process on the full tensors (the same Config without any parallelism, the
same init and batches) trained the same 3 AdamW steps; and the same model with
``use_local_map`` alone (DTensors between the regions), which must issue the same
collectives per step. Tensor parallel, sequence parallel, FSDP x TP (4 ranks) and full
activation checkpointing of the blocks; the layouts it does not compose with are refused.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama, pipeline_llama
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import CommDebugMode, DeviceMesh, DTensor, init_device_mesh
from hyper_parallel.platform import get_platform

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 48
REL = 1e-4


def _tiny(**flags: Any) -> Llama.Config:
    return Llama.Config(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        max_seq_len=16,
        **flags,
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(
    model: Llama, dp_mesh: DeviceMesh | None = None, record: bool = True
) -> list[dict[str, Any]]:
    """3 AdamW steps (the second on packed documents); per step the loss (averaged over
    ``dp_mesh``), full gradients, params after the step and the count of each collective."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    dp = dp_mesh.size() if dp_mesh is not None else 1
    index = dp_mesh.get_local_rank(0) if dp_mesh is not None else 0
    rows = slice(index * BATCH // dp, (index + 1) * BATCH // dp)
    out = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        # the middle step packs documents: the blocks pass their TokenLayout to attention
        documents = (torch.arange(SEQ) >= torch.arange(2, 2 + BATCH)[:, None]).long()
        with CommDebugMode() as comm:
            loss = model.loss(
                tokens[rows], targets[rows], document_ids=documents[rows] if step == 1 else None
            )
            torch.autograd.backward(loss)
        value = _full(loss)
        if dp_mesh is not None:
            value = get_platform().all_reduce(value, dp_mesh.get_group(0), "avg")
        grads = {}
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            grads[name] = _full(p.grad)
        opt.step()
        opt.zero_grad()
        out.append(
            {
                "loss": value,
                "grads": grads,
                "params": {name: _full(p) for name, p in model.named_parameters()},
                "comm": dict(Counter(r.kind for r in comm.records())) if record else {},
            }
        )
    return out


def _parallel_run(
    config: Llama.Config,
    source: Llama,
    mesh: DeviceMesh | ParallelDims,
    job_config: dict[str, Any] | None = None,
    dp_mesh: DeviceMesh | None = None,
) -> list[dict[str, Any]]:
    model = config.build()
    model.load_state_dict(source.state_dict())
    parallelize_llama(model, mesh, job_config)
    seen: set[str] = set()  # what the block hands its parts (forward pre-hooks see the call)
    for part in ("attention_norm", "attention", "ffn_norm", "feed_forward"):
        model.layers[0].get_submodule(part).register_forward_pre_hook(
            lambda _, args: seen.add(type(args[0]).__name__)
        )
    steps = _train(model, dp_mesh)
    steps[0]["parts_receive"] = sorted(seen)
    return steps


def _one_process(config: Llama.Config) -> tuple[Llama, list[dict[str, Any]]]:
    """The initialised source model and its run on one process (full tensors)."""
    torch.manual_seed(0)
    source = config.build()
    source.init_weights()
    one = config.build()
    one.load_state_dict(source.state_dict())
    return source, _train(one)


def _tp_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    result: dict[str, Any] = {}
    for sp in (False, True):
        source, result[f"one_{sp}"] = _one_process(_tiny(sequence_parallel=sp))
        local_map = _tiny(use_local_map=True, sequence_parallel=sp)
        region = local_map.replace(region_blocks=True)
        # with sequence parallel through ParallelDims (as hp-train parallelizes): each state
        # on its own view, the norms' declared Partial gradients resolved on theirs
        dims = ParallelDims(dp_shard=1, tp=2) if sp else mesh
        result[f"region_{sp}"] = _parallel_run(region, source, dims)
        result[f"local_map_{sp}"] = _parallel_run(local_map, source, mesh)
        result[f"region_ac_{sp}"] = _parallel_run(
            region, source, mesh, {"activation_checkpoint": "full"}
        )
    result["cp_refusal"] = _cp_refusal()
    return result


def _cp_refusal() -> tuple[str, bool]:
    """The error of parallelizing region_blocks over ``cp``; whether the model stayed plain."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = _tiny(use_local_map=True, region_blocks=True).build()
    try:
        parallelize_llama(model, mesh)
    except ValueError as error:
        untouched = model.context_parallel is None and not any(
            isinstance(p, DTensor) for p in model.parameters()
        )
        return str(error), untouched
    return "no error", False


def _fsdp_tp_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    result: dict[str, Any] = {}
    for sp in (False, True):
        source, result[f"one_{sp}"] = _one_process(_tiny(sequence_parallel=sp))
        region = _tiny(use_local_map=True, region_blocks=True, sequence_parallel=sp)
        result[f"region_{sp}"] = _parallel_run(
            region,
            source,
            mesh,
            {"activation_checkpoint": "full"} if sp else None,
            mesh["dp_shard"],
        )
    return result


@pytest.fixture(scope="module")
def tp2() -> dict[str, Any]:
    return run_on_ranks(_tp_runs, 2, timeout_s=180)[0]


@pytest.fixture(scope="module")
def fsdp2_tp2() -> dict[str, Any]:
    return run_on_ranks(_fsdp_tp_runs, 4, timeout_s=180)[0]


def _assert_same_training(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{what}, step {step}"
        assert_close_to_scale(g["loss"], w["loss"], rel=REL, what=f"{where}: loss")
        assert g["grads"].keys() == w["grads"].keys()
        for name, grad in w["grads"].items():
            assert_close_to_scale(g["grads"][name], grad, rel=REL, what=f"{where}: {name}.grad")
        for name, param in w["params"].items():
            assert_close_to_scale(g["params"][name], param, rel=REL, what=f"{where}: {name}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_train_like_one_process(tp2: dict[str, Any], sp: bool) -> None:
    _assert_same_training(tp2[f"region_{sp}"], tp2[f"one_{sp}"], f"region_blocks sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_hand_their_parts_plain_tensors(tp2: dict[str, Any], sp: bool) -> None:
    assert tp2[f"region_{sp}"][0]["parts_receive"] == ["Tensor"]
    assert tp2[f"local_map_{sp}"][0]["parts_receive"] == ["DTensor"]  # the path it replaces


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_issue_the_collectives_of_local_map_alone(
    tp2: dict[str, Any], sp: bool
) -> None:
    region = [step["comm"] for step in tp2[f"region_{sp}"]]
    local_map = [step["comm"] for step in tp2[f"local_map_{sp}"]]
    assert all(region), "CommDebugMode recorded no collective"
    assert region == local_map
    _assert_same_training(tp2[f"region_{sp}"], tp2[f"local_map_{sp}"], f"vs use_local_map sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_checkpointed_recompute_the_same_step(tp2: dict[str, Any], sp: bool) -> None:
    _assert_same_training(tp2[f"region_ac_{sp}"], tp2[f"region_{sp}"], f"full AC sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["fsdp2xtp2", "fsdp2xtp2-sp-ac"])
def test_region_blocks_under_fsdp_and_tp_train_like_one_process(
    fsdp2_tp2: dict[str, Any], sp: bool
) -> None:
    _assert_same_training(fsdp2_tp2[f"region_{sp}"], fsdp2_tp2[f"one_{sp}"], f"FSDP x TP sp={sp}")


def test_region_blocks_refuse_context_parallelism_before_changing_the_model(
    tp2: dict[str, Any],
) -> None:
    message, untouched = tp2["cp_refusal"]
    assert "region_blocks" in message and "'cp'" in message, message
    assert untouched


def test_region_blocks_refuse_a_pipeline() -> None:
    model = _tiny(use_local_map=True, region_blocks=True).build()
    with pytest.raises(ValueError, match=r"pipeline_llama: region_blocks=true .*pipeline"):
        pipeline_llama(model, ParallelDims(pp=2, dp_shard=1, world_size=2))


def test_region_blocks_need_use_local_map() -> None:
    with pytest.raises(ConfigError, match=r"^region_blocks: expected use_local_map=true"):
        _tiny(region_blocks=True)

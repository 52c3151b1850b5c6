"""qwen3-ref on local tensors: ``use_local_map`` (norms, attention with its per-head q/k
norms, dense feed-forward as ``local_map`` regions) and ``region_blocks`` (each dense block
one outer region, its parts inner regions, the residual stream plain local tensors).

Oracles: one process on the full tensors (the same Config without any parallelism, the
same init and batches) trained the same 3 AdamW steps; and the same model on the DTensor
path (neither flag), whose collectives per step (CommDebugMode) ``use_local_map`` and
``region_blocks`` must issue, kind for kind. Tensor and sequence parallel on 2 ranks,
a mixed dense/MoE model (experts over ``ep`` borrowing ``tp``), and on 4 ranks FSDP x TP
and pipeline stages x TP (sequence parallel).
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
from hyper_parallel.dmodule.models.qwen3 import Qwen3, parallelize_qwen3, pipeline_qwen3
from hyper_parallel.dmodule.models.qwen3_block import Qwen3Block
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import CommDebugMode, DeviceMesh, DTensor, init_device_mesh
from hyper_parallel.platform import get_platform

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 48
REL = 1e-4
# parameters after AdamW steps of the MoE model: the first step divides each gradient by
# its own magnitude, so gradients near zero (experts few tokens reach) move their weights
# by a sign; the DTensor path of the same model lands 1.7e-4 from one process
MOE_PARAMS_REL = 1e-3


def _tiny(**flags: Any) -> Qwen3.Config:
    return Qwen3.Config(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=48,
        max_seq_len=16,
        **flags,
    )


def _tiny_moe(**flags: Any) -> Qwen3.Config:
    """Block 0 dense, block 1 a mixture of 4 experts (transformers' decoder_sparse_step)."""
    return _tiny(num_experts=4, top_k=2, moe_ffn_dim=16, decoder_sparse_step=2, **flags)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: Qwen3, dp_mesh: DeviceMesh | None = None) -> list[dict[str, Any]]:
    """3 AdamW steps; per step the loss (averaged over ``dp_mesh``), full gradients, params
    after the step and the count of each collective CommDebugMode recorded."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    dp = dp_mesh.size() if dp_mesh is not None else 1
    index = dp_mesh.get_local_rank(0) if dp_mesh is not None else 0
    rows = slice(index * BATCH // dp, (index + 1) * BATCH // dp)
    out = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        with CommDebugMode() as comm:
            loss = model.loss(tokens[rows], targets[rows])
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
                "comm": dict(Counter(r.kind for r in comm.records())),
            }
        )
    return out


def _watch_block_parts(model: torch.nn.Module) -> list[set[str]]:
    """Per block, the type names of what it hands its parts as they are called (forward
    pre-hooks see the call, before a region takes anything local)."""
    seen: list[set[str]] = []
    for block in (m for m in model.modules() if isinstance(m, Qwen3Block)):
        names: set[str] = set()
        seen.append(names)
        for part in (block.attention_norm, block.attention, block.ffn_norm, block.feed_forward):
            part.register_forward_pre_hook(
                lambda _, args, names=names: names.add(type(args[0]).__name__)
            )
    return seen


def _parallel_run(
    config: Qwen3.Config,
    source: Qwen3,
    mesh: DeviceMesh | ParallelDims,
    job_config: dict[str, Any] | None = None,
    dp_mesh: DeviceMesh | None = None,
) -> list[dict[str, Any]]:
    model = config.build()
    model.load_state_dict(source.state_dict())
    parallelize_qwen3(model, mesh, job_config)
    seen = _watch_block_parts(model)
    steps = _train(model, dp_mesh)
    steps[0]["parts_receive"] = [sorted(names) for names in seen]
    return steps


def _one_process(config: Qwen3.Config) -> tuple[Qwen3, list[dict[str, Any]]]:
    """The initialised source model and its run on one process (full tensors)."""
    torch.manual_seed(0)
    source = config.build()
    source.init_weights()
    one = config.build()
    one.load_state_dict(source.state_dict())
    return source, _train(one)


def _two_rank_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    result: dict[str, Any] = {}
    for sp in (False, True):
        source, result[f"one_{sp}"] = _one_process(_tiny(sequence_parallel=sp))
        local_map = _tiny(use_local_map=True, sequence_parallel=sp)
        result[f"dtensor_{sp}"] = _parallel_run(_tiny(sequence_parallel=sp), source, mesh)
        result[f"local_map_{sp}"] = _parallel_run(local_map, source, mesh)
        # with sequence parallel through ParallelDims (as hp-train parallelizes): each state
        # on its own view, the declared Partial gradients resolved on theirs
        dims = ParallelDims(dp_shard=1, tp=2) if sp else mesh
        result[f"region_{sp}"] = _parallel_run(local_map.replace(region_blocks=True), source, dims)
    # dense block 0 and MoE block 1; the experts split over ep, which borrows tp's ranks
    source, result["one_moe"] = _one_process(_tiny_moe())
    dims = ParallelDims(dp_shard=1, tp=2, ep=2)
    result["dtensor_moe"] = _parallel_run(_tiny_moe(), source, dims)
    region = _tiny_moe(use_local_map=True, region_blocks=True)
    result["region_moe"] = _parallel_run(region, source, dims)
    return result


def _pipeline_run(config: Qwen3.Config, dims: ParallelDims) -> dict[str, Any]:
    """This rank's stage of a 2-stage pipeline (2 microbatches), trained as :func:`_train`:
    its init, and per step the loss (last stage only), its gradients and params."""
    with torch.device("meta"):
        model = config.build()
    pipe = pipeline_qwen3(model, dims, {"pipeline": {"schedule": "1F1B", "n_microbatches": 2}})
    torch.manual_seed(0)  # as _one_process: a pipeline's init equals one process's
    pipe.init_weights()
    params = {name: p for part in pipe.model_parts for name, p in part.named_parameters()}
    init = {name: _full(p) for name, p in params.items()}
    seen = _watch_block_parts(pipe.model_parts[0])
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=False)
    steps = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        loss = pipe.step(tokens, target=targets)
        grads = {}
        for name, p in params.items():
            assert p.grad is not None, name
            grads[name] = _full(p.grad)
        opt.step()
        opt.zero_grad()
        steps.append(
            {
                "loss": None if loss is None else _full(loss),
                "grads": grads,
                "params": {name: _full(p) for name, p in params.items()},
            }
        )
    return {"init": init, "steps": steps, "parts_receive": [sorted(names) for names in seen]}


def _four_rank_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    result: dict[str, Any] = {}
    source, result["one"] = _one_process(_tiny(sequence_parallel=True))
    region = _tiny(use_local_map=True, region_blocks=True, sequence_parallel=True)
    # FSDP x TP, the blocks checkpointed: FSDP unshards a block's parameters to DTensors in
    # its pre-forward, the region takes their local views (the recompute's too)
    result["fsdp_tp"] = _parallel_run(
        region, source, mesh, {"activation_checkpoint": "full"}, mesh["dp_shard"]
    )
    result["init"] = {name: _full(p) for name, p in source.named_parameters()}
    result["pp_tp"] = _pipeline_run(region, ParallelDims(dp_shard=1, pp=2, tp=2))
    return result


@pytest.fixture(scope="module")
def tp2() -> dict[str, Any]:
    return run_on_ranks(_two_rank_runs, 2, timeout_s=180)[0]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_four_rank_runs, 4, timeout_s=180)


def _assert_same_training(
    got: list[dict[str, Any]], want: list[dict[str, Any]], what: str, params_rel: float = REL
) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{what}, step {step}"
        assert_close_to_scale(g["loss"], w["loss"], rel=REL, what=f"{where}: loss")
        assert g["grads"].keys() == w["grads"].keys()
        for name, grad in w["grads"].items():
            assert_close_to_scale(g["grads"][name], grad, rel=REL, what=f"{where}: {name}.grad")
        for name, param in w["params"].items():
            assert_close_to_scale(g["params"][name], param, rel=params_rel, what=f"{where}: {name}")


@pytest.mark.parametrize("flag", ["local_map", "region"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_local_tensor_paths_train_like_one_process(
    tp2: dict[str, Any], sp: bool, flag: str
) -> None:
    _assert_same_training(tp2[f"{flag}_{sp}"], tp2[f"one_{sp}"], f"{flag} sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_use_local_map_issues_the_collectives_of_the_dtensor_path(
    tp2: dict[str, Any], sp: bool
) -> None:
    """The same kinds and counts per step: the regions' declared moves are the collectives
    the DTensor ops made (q/k norm gradients: one all-reduce each, as their Partial)."""
    local_map = [step["comm"] for step in tp2[f"local_map_{sp}"]]
    assert all(local_map), "CommDebugMode recorded no collective"
    assert local_map == [step["comm"] for step in tp2[f"dtensor_{sp}"]]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_issue_the_collectives_of_use_local_map(
    tp2: dict[str, Any], sp: bool
) -> None:
    region = [step["comm"] for step in tp2[f"region_{sp}"]]
    assert region == [step["comm"] for step in tp2[f"local_map_{sp}"]]
    _assert_same_training(tp2[f"region_{sp}"], tp2[f"local_map_{sp}"], f"vs use_local_map sp={sp}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_hand_their_parts_plain_tensors(tp2: dict[str, Any], sp: bool) -> None:
    assert tp2[f"region_{sp}"][0]["parts_receive"] == [["Tensor"], ["Tensor"]]
    assert tp2[f"local_map_{sp}"][0]["parts_receive"] == [["DTensor"], ["DTensor"]]


def test_moe_model_with_region_blocks_trains_like_one_process(tp2: dict[str, Any]) -> None:
    got = tp2["region_moe"]
    # the dense block is a region; the MoE block is not: its parts get DTensors
    assert got[0]["parts_receive"] == [["Tensor"], ["DTensor"]]
    what = "dense + MoE, region_blocks, tp2 x ep2"
    _assert_same_training(got, tp2["one_moe"], what, params_rel=MOE_PARAMS_REL)
    region = [step["comm"] for step in got]
    assert all(region), "CommDebugMode recorded no collective"
    assert region == [step["comm"] for step in tp2["dtensor_moe"]]


def test_region_blocks_under_fsdp_x_tp_train_like_one_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    found = four_ranks[0]
    assert found["fsdp_tp"][0]["parts_receive"] == [["Tensor"], ["Tensor"]]
    _assert_same_training(found["fsdp_tp"], found["one"], "fsdp2 x tp2, sp, full AC")


@pytest.mark.parametrize("flag", ["region_blocks", "compile_local_map"])
def test_region_blocks_and_compile_need_use_local_map(flag: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{flag}: expected use_local_map=true") as error:
        _tiny(**{flag: True})
    assert error.value.path == flag


def test_region_blocks_in_pipeline_stages_train_like_one_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    want = four_ranks[0]["one"]
    losses = 0
    for rank, found in enumerate(four_ranks):  # pp x tp: ranks 0-1 stage 0, 2-3 stage 1
        got = found["pp_tp"]
        assert got["parts_receive"] == [["Tensor"]], f"rank {rank}: the stage's block is a region"
        for name, param in got["init"].items():
            assert torch.equal(param, four_ranks[0]["init"][name]), f"rank {rank}: init {name}"
        for step, (g, w) in enumerate(zip(got["steps"], want, strict=True)):
            where = f"pp2xtp2 rank {rank}, step {step}"
            if g["loss"] is not None:
                losses += 1
                assert_close_to_scale(g["loss"], w["loss"], rel=REL, what=f"{where}: loss")
            for name, grad in g["grads"].items():
                assert_close_to_scale(grad, w["grads"][name], rel=REL, what=f"{where}: {name}")
            for name, param in g["params"].items():
                assert_close_to_scale(param, w["params"][name], rel=REL, what=f"{where}: {name}")
    assert losses == 2 * STEPS  # the last stage's two tp ranks
    stages = [set(found["pp_tp"]["init"]) for found in four_ranks]
    assert stages[0] | stages[2] == set(want[0]["params"]), "the stages hold every parameter"

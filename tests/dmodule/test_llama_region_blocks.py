"""llama-ref with ``region_blocks``: each block one outer ``local_map`` region, its norms,
attention and feed-forward inner regions, the residual stream plain local tensors.

Oracles: one process on the full tensors (the same Config without any parallelism, the
same init and batches) trained the same 3 AdamW steps; and the same model with
``use_local_map`` alone (DTensors between the regions), which must issue the same
collectives per step. Tensor parallel, sequence parallel, activation checkpointing of
the blocks, packed documents; on 4 ranks TP composed with FSDP, context parallelism and
pipeline stages.
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
from hyper_parallel.dmodule.layers import TransformerBlock
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


def _documents() -> torch.Tensor:
    """Two packed documents per row, the second starting at token 2 + row."""
    return (torch.arange(SEQ) >= torch.arange(2, 2 + BATCH)[:, None]).long()


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
        documents = _documents()[rows] if step == 1 else None
        with CommDebugMode() as comm:
            loss = model.loss(tokens[rows], targets[rows], document_ids=documents)
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
    seen = _watch_block_parts(model)
    steps = _train(model, dp_mesh)
    steps[0]["parts_receive"] = sorted(seen)
    return steps


def _watch_block_parts(model: torch.nn.Module) -> set[str]:
    """The type names of what the first block in ``model`` hands its parts, as they are called
    (forward pre-hooks see the call, before a region takes anything local)."""
    seen: set[str] = set()
    block = next(m for m in model.modules() if isinstance(m, TransformerBlock))
    for part in (block.attention_norm, block.attention, block.ffn_norm, block.feed_forward):
        part.register_forward_pre_hook(lambda _, args: seen.add(type(args[0]).__name__))
    return seen


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
        for mode in ("full", "selective"):
            result[f"region_{mode}_ac_{sp}"] = _parallel_run(
                region, source, mesh, {"activation_checkpoint": mode}
            )
    return result


def _pipeline_run(config: Llama.Config, dims: ParallelDims) -> dict[str, Any]:
    """This rank's stage of a 2-stage pipeline (2 microbatches), trained as :func:`_train`:
    its init, and per step the loss (last stage only), its gradients and params."""
    with torch.device("meta"):
        model = config.build()
    pipe = pipeline_llama(model, dims, {"pipeline": {"schedule": "1F1B", "n_microbatches": 2}})
    torch.manual_seed(0)  # as _one_process: a pipeline's init equals one process's
    pipe.init_weights()
    params = {name: p for part in pipe.model_parts for name, p in part.named_parameters()}
    init = {name: _full(p) for name, p in params.items()}
    seen = _watch_block_parts(pipe.model_parts[0])
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=False)
    steps = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        docs = {"document_ids": _documents()} if step == 1 else {}
        loss = pipe.step(tokens, target=targets, **docs)
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
    return {"init": init, "steps": steps, "parts_receive": sorted(seen)}


def _four_rank_runs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    result: dict[str, Any] = {}
    source, result["one"] = _one_process(_tiny(sequence_parallel=True))
    result["init"] = {name: _full(p) for name, p in source.named_parameters()}
    region = _tiny(use_local_map=True, region_blocks=True, sequence_parallel=True)
    # FSDP x TP, the blocks checkpointed: FSDP unshards a block's parameters to DTensors in
    # its pre-forward, the region takes their local views (the recompute's too)
    result["fsdp_tp"] = _parallel_run(
        region, source, mesh, {"activation_checkpoint": "full"}, mesh["dp_shard"]
    )
    # context parallel x TP: the sequence split over cp, every rank given the whole batch
    result["cp_tp"] = _parallel_run(region, source, ParallelDims(dp_shard=1, cp=2, tp=2))
    result["pp_tp"] = _pipeline_run(region, ParallelDims(dp_shard=1, pp=2, tp=2))
    return result


@pytest.fixture(scope="module")
def tp2() -> dict[str, Any]:
    return run_on_ranks(_tp_runs, 2, timeout_s=180)[0]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_four_rank_runs, 4, timeout_s=180)


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


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_region_blocks_checkpointed_recompute_the_same_step(
    tp2: dict[str, Any], sp: bool, mode: str
) -> None:
    got = tp2[f"region_{mode}_ac_{sp}"]
    _assert_same_training(got, tp2[f"region_{sp}"], f"{mode} AC sp={sp}")


@pytest.mark.parametrize("layout", ["fsdp_tp", "cp_tp"], ids=["fsdp2xtp2-ac", "cp2xtp2"])
def test_region_blocks_composed_with_sp_train_like_one_process(
    four_ranks: list[dict[str, Any]], layout: str
) -> None:
    found = four_ranks[0]
    assert found[layout][0]["parts_receive"] == ["Tensor"]  # the blocks are regions
    _assert_same_training(found[layout], found["one"], f"{layout}, sequence parallel")


def test_region_blocks_in_pipeline_stages_train_like_one_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    want = four_ranks[0]["one"]
    losses = 0
    for rank, found in enumerate(four_ranks):  # pp x tp: ranks 0-1 stage 0, 2-3 stage 1
        got = found["pp_tp"]
        assert got["parts_receive"] == ["Tensor"], f"rank {rank}: the blocks are regions"
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


def test_region_blocks_need_use_local_map() -> None:
    with pytest.raises(ConfigError, match=r"^region_blocks: expected use_local_map=true"):
        _tiny(region_blocks=True)

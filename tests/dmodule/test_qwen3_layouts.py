"""qwen3-ref's MoE under pipeline x expert parallelism and expert tensor parallelism.

One 4-rank launch runs every layout (with ``test_qwen3.py``'s ``ep=2 x efsdp=2``):

- ``ParallelDims(pp=2, dp_shard=2, ep=2)``: the spec's ``pipelining_fn`` (torch's 1F1B),
  MoE blocks on both stages with aux-loss-free balancing, ``update_load_balance`` per
  stage after each AdamW step. Oracle: one process, the same Qwen3 built and initialised
  after the same seed, trained on the global batch: initial values bitwise, losses,
  gradients, parameters and expert biases to scale.
- ``ParallelDims(dp_shard=2, tp=2, ep=2)``: ``ep`` borrows ``tp``'s ranks (``etp = 1``),
  each tp rank routing half of its group's tokens; against transformers as below.
- Tied embeddings under ``ParallelDims(dp_shard=2, tp=2)`` (one FSDP unit holds the shared
  weight): a dense Qwen3 loaded from, trained like and saved as transformers' tied model;
  llama-ref's ``parallelize_llama`` against one process.
- ``ParallelDims(dp_shard=2, tp=2, ep=2, etp=2)``, with and without sequence parallelism:
  ``parallelize_qwen3`` turns on the experts' ``etp`` layout; loaded from a transformers
  checkpoint, trained and saved, then compared with transformers' ``Qwen3MoeForCausalLM``
  trained on the global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dmodule.test_qwen3 import (  # skips this module too without transformers
    Oracle,
    _check_run,
    _dense_hf_config,
    _hf_model,
    _moe_hf_config,
    _read_dir,
    _train_parallel,
    _transformers_oracle,
    transformers,
)

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.layers import update_load_balance
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3, pipeline_qwen3
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import DTensor

# layer 0 dense, layers 1-3 MoE: each of the 2 stages holds MoE blocks
CONFIG = Qwen3.Config(
    vocab_size=32,
    dim=16,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=32,
    max_seq_len=8,
    num_experts=4,
    top_k=2,
    moe_ffn_dim=12,
    mlp_only_layers=(0,),
    load_balance_coeff=0.05,  # large enough to change which experts some tokens pick
)
BATCH, SEQ, MICROBATCHES, STEPS, LR, SEED = 8, 8, 2, 3, 1e-2, 0
ETP_DEGREES = {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 2}
EFSDP_DEGREES = {"dp_shard": 4, "ep": 2}  # experts' FSDP over efsdp=2
EP_TP_DEGREES = {"dp_shard": 2, "tp": 2, "ep": 2}  # etp=1: ep borrows tp's ranks

Record = dict[str, Any]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _biases(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(b) for n, b in module.named_buffers() if n.endswith("expert_bias")}


def _pipeline_pp2_ep2() -> Record:
    """pp=2 x dp_shard=2 x ep=2 through the spec's pipelining_fn: what this rank saw."""
    dims = ParallelDims(pp=2, dp_shard=2, ep=2)
    with torch.device("meta"):
        model = CONFIG.build()
    spec = get_spec("qwen3-ref")
    assert spec.pipelining_fn is not None
    options = {"schedule": "1F1B", "n_microbatches": MICROBATCHES}
    pipe = spec.pipelining_fn(model, dims, {"pipeline": options})
    torch.manual_seed(SEED)
    pipe.init_weights()
    (part,) = pipe.model_parts
    params = dict(part.named_parameters())
    rows = BATCH // dims.dp
    begin = dims.batch_mesh.get_local_rank() * rows
    record: Record = {
        "init": {n: _full(p) for n, p in params.items()},
        "expert_shapes": {
            n: tuple(p.to_local().shape) for n, p in params.items() if ".experts." in n
        },
        "losses": [],
        "grads": [],
        "params": [],
        "biases": [],
    }
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=32)
        optimizer.zero_grad()
        loss = pipe.step(tokens[begin : begin + rows], target=targets[begin : begin + rows])
        record["losses"].append(None if loss is None else float(loss))
        record["grads"].append({n: _full(p.grad) for n, p in params.items() if p.grad is not None})
        optimizer.step()
        update_load_balance(part, dims)  # this stage's MoE blocks, counts over the dp ranks
        record["params"].append({n: _full(p) for n, p in params.items()})
        record["biases"].append(_biases(part))
    return record


def _tied_hf_config() -> Any:
    config = _dense_hf_config()
    config.tie_word_embeddings = True
    return config


TIED_LLAMA = Llama.Config(
    vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, max_seq_len=8
).replace(tie_word_embeddings=True)


def _llama_tied_fsdp_tp() -> Record:
    """parallelize_llama(dp_shard=2 x tp=2) of a tied llama-ref: its largest differences from
    one process (after the same seed) in init, loss, gradients and AdamW steps."""
    dims = ParallelDims(dp_shard=2, tp=2)
    torch.manual_seed(SEED)
    reference = TIED_LLAMA.build()
    reference.init_weights()
    with torch.device("meta"):
        model = TIED_LLAMA.build()
    parallelize_llama(model, dims)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    record: Record = {
        "names": sorted(ours),
        "tied": model.output.weight is model.tok_embeddings.weight,
        "init": max(float((_full(ours[n]) - theirs[n].detach()).abs().max()) for n in theirs),
        "loss": [],
        "grads": [],
        "params": [],
    }
    rows = BATCH // dims.dp
    begin = dims.batch_mesh.get_local_rank() * rows
    opt = torch.optim.AdamW(list(ours.values()), lr=LR, foreach=False)
    opt_ref = torch.optim.AdamW(list(theirs.values()), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=32)
        loss = model.loss(tokens[begin : begin + rows], targets[begin : begin + rows])
        loss.backward()
        reference.loss(tokens, targets).backward()
        record["grads"].append(
            max(float((_full(ours[n].grad) - theirs[n].grad).abs().max()) for n in theirs)
        )
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        record["params"].append(
            max(float((_full(ours[n]) - theirs[n].detach()).abs().max()) for n in theirs)
        )
    return record


def _layouts(hf_dir: str, out_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "tied": _train_parallel(f"{out_dir}/hf-tied", f"{out_dir}/tied", {"dp_shard": 2, "tp": 2}),
        "llama_tied": _llama_tied_fsdp_tp(),
        "pp2_ep2": _pipeline_pp2_ep2(),
        "efsdp2": _train_parallel(hf_dir, f"{out_dir}/efsdp2", EFSDP_DEGREES),
        "etp2": _train_parallel(hf_dir, f"{out_dir}/etp2", ETP_DEGREES),
        "etp2_sp": _train_parallel(hf_dir, f"{out_dir}/etp2_sp", ETP_DEGREES, True),
        "ep_tp": _train_parallel(hf_dir, f"{out_dir}/ep_tp", EP_TP_DEGREES),
    }


Launch = tuple[Path, Oracle, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The 4-rank launch, and transformers' results on the checkpoint it loaded."""
    tmp_path = tmp_path_factory.mktemp("qwen3_layouts")
    hf = _hf_model(_moe_hf_config())
    hf.save_pretrained(tmp_path / "hf")
    _hf_model(_tied_hf_config()).save_pretrained(tmp_path / "hf-tied")
    results = run_on_ranks(_layouts, 4, str(tmp_path / "hf"), str(tmp_path), timeout_s=400)
    return tmp_path, _transformers_oracle(tmp_path, hf), results


def test_pp2_ep2_pipeline_trains_and_balances_as_one_process(launch: Launch) -> None:
    records = [rank["pp2_ep2"] for rank in launch[2]]
    for record in records:
        for name, shape in record["expert_shapes"].items():  # 2 of the 4 experts each
            assert shape[0] == 2, (name, shape)
    reference = CONFIG.build()
    torch.manual_seed(SEED)
    reference.init_weights()
    params = dict(reference.named_parameters())
    held = sorted({n for r in records for n in r["init"]})
    assert held == sorted(params), "the stages together hold every parameter"
    assert sum(bool(r["biases"][0]) for r in records) == 4, "MoE blocks on both stages"
    for record in records:
        for name, value in record["init"].items():
            assert torch.equal(value, params[name].detach()), f"init of {name}"
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=32)
        optimizer.zero_grad()
        loss = reference.loss(tokens, targets)
        loss.backward()
        # the last stage's two dp ranks each return their rows' mean: together the batch's
        losses = [r["losses"][step] for r in records if r["losses"][step] is not None]
        assert len(losses) == 2
        assert_close_to_scale(
            torch.tensor(sum(losses) / 2), loss.detach(), rel=1e-5, what=f"loss {step}"
        )
        for record in records:
            for name, grad in record["grads"][step].items():
                assert_close_to_scale(grad, params[name].grad, rel=1e-4, what=f"{name}.grad")
        with torch.no_grad():  # given identical gradients, Adam cannot amplify rounding
            for record in records:
                for name, grad in record["grads"][step].items():
                    params[name].grad.copy_(grad)
        optimizer.step()
        update_load_balance(reference)
        want_biases = _biases(reference)
        for record in records:
            for name, value in record["params"][step].items():
                assert_close_to_scale(value, params[name].detach(), rel=1e-5, what=name)
            for name, bias in record["biases"][step].items():
                assert torch.equal(bias, want_biases[name]), f"{name} after step {step}"
    assert any(bool(b.abs().sum()) for b in want_biases.values()), "the biases moved"


def test_ep2_efsdp2_shards_experts_over_efsdp_and_trains_like_transformers(
    launch: Launch,
) -> None:
    tmp_path, oracle, ranks = launch
    results = [rank["efsdp2"] for rank in ranks]
    for result in results:  # ep=2 x efsdp=2: each rank reads and holds 1 of the 4 experts
        assert result["local_shapes"]["layers.1.feed_forward.experts.w1"] == (1, 12, 16)
    _check_run(tmp_path / "efsdp2", results, oracle)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "efsdp2")
    assert type(loaded) is transformers.Qwen3MoeConfig
    assert (loaded.num_experts, loaded.mlp_only_layers) == (4, [0])


@pytest.mark.parametrize("run", ["etp2", "etp2_sp"], ids=["replicated", "sequence-parallel"])
def test_tp2_ep2_etp2_splits_expert_hidden_units_and_trains_like_transformers(
    launch: Launch, run: str
) -> None:
    tmp_path, oracle, ranks = launch
    results = [rank[run] for rank in ranks]
    for result in results:
        shapes = result["local_shapes"]
        # ep=2: 2 of 4 experts; etp=2: 6 of their 12 hidden units (w1/w3 dim 1, w2 dim 2)
        assert shapes["layers.1.feed_forward.experts.w1"] == (2, 6, 16)
        assert shapes["layers.1.feed_forward.experts.w2"] == (2, 16, 6)
    # sequence parallel: the MoE gathers the sequence shards and slices its output back
    _check_run(tmp_path / run, results, oracle)


def test_ep2_borrowing_tp2_routes_each_token_once_and_trains_like_transformers(
    launch: Launch,
) -> None:
    # etp=1 with tp=2: each tp rank routes half of its group's tokens, so an expert's
    # gradient counts each token once (its mean divides by dp, not dp x tp)
    tmp_path, oracle, ranks = launch
    results = [rank["ep_tp"] for rank in ranks]
    for result in results:  # ep=2 x efsdp=dp_shard*tp/ep=2: 1 of the 4 experts, whole
        assert result["local_shapes"]["layers.1.feed_forward.experts.w1"] == (1, 12, 16)
    _check_run(tmp_path / "ep_tp", results, oracle)


def test_tied_embeddings_under_fsdp_and_tp_train_and_save_like_transformers(
    launch: Launch,
) -> None:
    tmp_path, _, ranks = launch
    hf = _hf_model(_tied_hf_config())  # the weights the launch loaded (same seed)
    oracle = _transformers_oracle(tmp_path / "tied-oracle", hf)
    want_logits, want_grads, theirs = oracle
    for result in [rank["tied"] for rank in ranks]:
        assert_close_to_scale(result["logits"], want_logits, rel=1e-5, what="loaded logits")
        # one shared weight: its gradient once, under the embedding's key (both uses summed)
        assert sorted(result["grads"]) == sorted(want_grads)
        assert "lm_head.weight" not in result["grads"]
        for key, want in want_grads.items():
            assert_close_to_scale(result["grads"][key], want, rel=1e-5, what=f"{key}.grad")
    ours = _read_dir(tmp_path / "tied")
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" not in ours
    # FSDP's reduce-scatter sums the data ranks' gradients in another order than one process;
    # AdamW divides by sqrt(v), so an element whose gradient is ~0 turns that rounding into a
    # step of up to lr: 3 steps later such elements differ by ~1e-5 of the weights' scale
    for key, want in theirs.items():
        assert_close_to_scale(ours[key], want, rel=1e-3, what=f"{key} after 3 steps")


def test_tied_llama_under_fsdp_and_tp_trains_as_one_process(launch: Launch) -> None:
    for rank in launch[2]:
        found = rank["llama_tied"]
        assert found["tied"] and "output.weight" not in found["names"]
        assert found["init"] == 0.0
        assert max(found["grads"]) < 1e-5, found["grads"]
        assert max(found["params"]) < 1e-4, found["params"]


def test_qwen3_pipelining_fn_refuses_unknown_options_naming_itself() -> None:
    with torch.device("meta"):
        model = CONFIG.build()
    with pytest.raises(ValueError, match=r"pipeline_qwen3: .* names \['microbatches'\]"):
        pipeline_qwen3(model, ParallelDims(pp=2, world_size=2), {"pipeline": {"microbatches": 2}})

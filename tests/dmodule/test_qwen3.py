"""qwen3-ref against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM: logits and training.

The oracle is transformers itself: a tiny model with random weights saved with
``save_pretrained`` (no download), run and trained in this process on the global batch.
The parallel side loads that directory with ``from_hf`` + ``load_hf`` on 2 ranks, trains
the same steps and writes itself back with ``save_hf``; the weights are compared key by
key in the Hub layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.checkpoint import load_hf, save_hf
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3, parallelize_qwen3
from hyper_parallel.dmodule.models.qwen3_hf import Qwen3StateDictAdapter
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import DTensor, init_device_mesh

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, BATCH, SEQ, STEPS, LR = 32, 4, 8, 3, 1e-2
TOKENS = torch.tensor([[1, 5, 9, 2, 7, 7, 3, 0], [4, 4, 8, 1, 6, 2, 9, 5]])


def _dense_hf_config() -> Any:
    # head_dim * n_heads (32) differs from hidden_size (16), as in the real Qwen3 models
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def _hf_model(config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cls = (
        transformers.Qwen3MoeForCausalLM
        if config.model_type == "qwen3_moe"
        else transformers.Qwen3ForCausalLM
    )
    model = cls(config)
    with torch.no_grad():  # transformers' init leaves norms at ones and the router at zero
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def _hf_logits(model: Any, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()  # type: ignore[no-any-return]


def _hf_train(model: Any) -> dict[str, torch.Tensor]:
    """transformers' model, STEPS AdamW steps on the global batch; the first step's gradients."""
    model.train()
    first: dict[str, torch.Tensor] = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        logits: torch.Tensor = model(tokens).logits
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        if step == 0:
            first = _hub_layout({n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return first


def _hub_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory tensors in the Hub's names (its fused experts split)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            prefix = name.removesuffix("gate_up_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


def _read_dir(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= safetensors_torch.load_file(str(file))
    return tensors


# -- one process ---------------------------------------------------------------------------
def test_load_hf_dense_one_process_gives_transformers_logits(tmp_path: Path) -> None:
    hf = _hf_model(_dense_hf_config())
    hf.save_pretrained(tmp_path)
    config = Qwen3.Config.from_hf(tmp_path)
    assert (config.head_dim, config.dim, config.num_experts) == (8, 16, 0)
    model = config.build()
    load_hf(model, tmp_path)
    with torch.no_grad():
        assert_close_to_scale(model(TOKENS), _hf_logits(hf.eval()), rel=1e-5, what="logits")


def test_save_hf_dense_writes_transformers_keys_and_a_loadable_config(tmp_path: Path) -> None:
    hf = _hf_model(_dense_hf_config())
    hf.save_pretrained(tmp_path / "hf")
    model = Qwen3.Config.from_hf(tmp_path / "hf").build()
    load_hf(model, tmp_path / "hf")
    save_hf(model, tmp_path / "ours")
    ours, theirs = _read_dir(tmp_path / "ours"), _read_dir(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(loaded) is transformers.Qwen3Config
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert_close_to_scale(_hf_logits(again), _hf_logits(hf.eval()), rel=1e-6, what="logits")


def test_from_hf_refuses_what_qwen3_ref_does_not_compute(tmp_path: Path) -> None:
    config = _dense_hf_config()
    config.attention_bias = True
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"attention_bias=True \(supported: False\)"):
        Qwen3.Config.from_hf(tmp_path)


def test_qwen3_is_registered_as_qwen3_ref_spec_with_dense_and_moe_flavors() -> None:
    spec = get_spec("qwen3-ref")
    dense, moe = spec.config("debug"), spec.config("debug-moe")
    assert isinstance(dense, Qwen3.Config) and isinstance(moe, Qwen3.Config)
    assert dense.num_experts == 0 and moe.num_experts > 0
    model = dense.replace(n_layers=1).build()
    model.verify_module_protocol()
    assert model(torch.randint(0, 256, (2, 8))).shape == (2, 8, 256)


# -- two ranks: load, train, save ----------------------------------------------------------
def _train_parallel(
    directory: str, out: str, degrees: dict[str, int], sequence_parallel: bool = False
) -> dict[str, Any]:
    """from_hf on meta, the spec's parallelize_fn, load_hf, STEPS AdamW steps, save_hf."""
    torch.set_num_threads(1)
    dims = ParallelDims(**degrees)
    batch_rank = dims.get_mesh("batch").get_local_rank() if dims.dp > 1 else 0
    rows = slice(batch_rank * BATCH // dims.dp, (batch_rank + 1) * BATCH // dims.dp)
    config = Qwen3.Config.from_hf(directory).replace(sequence_parallel=sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    spec = get_spec("qwen3-ref")
    assert spec.parallelize_fn is not None
    spec.parallelize_fn(model, dims)
    model.to_empty(device="cpu")
    model.init_weights()  # then overwritten: load_hf must fill every value
    load_hf(model, directory)
    with torch.no_grad():
        logits = model(TOKENS)
    result: dict[str, Any] = {
        "logits": logits.full_tensor() if isinstance(logits, DTensor) else logits,
        "local_shapes": {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        model.loss(tokens[rows], targets[rows]).backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        result.setdefault("grads_are_dtensors", True)
        result["grads_are_dtensors"] &= all(isinstance(g, DTensor) for g in grads.values())
        if step == 0:  # the whole gradient of the global batch's mean loss, in the Hub's names
            full = {k: g.full_tensor() for k, g in grads.items() if isinstance(g, DTensor)}
            result["grads"] = Qwen3StateDictAdapter(model.config).to_hf(full)
        optimizer.step()
        optimizer.zero_grad()
    save_hf(model, out, max_shard_bytes=16 * 1024)
    return result


def _check_training(tmp_path: Path, hf_config: Any, degrees: dict[str, int]) -> list[Any]:
    hf = _hf_model(hf_config)
    hf.save_pretrained(tmp_path / "hf")
    # ep and etp refactor the data/tensor ranks: they add none
    world_size = math.prod(n for axis, n in degrees.items() if axis not in ("ep", "etp"))
    results = run_on_ranks(
        _train_parallel,
        world_size,
        str(tmp_path / "hf"),
        str(tmp_path / "ours"),
        degrees,
        timeout_s=300,
    )
    _check_run(tmp_path / "ours", results, _transformers_oracle(tmp_path, hf))
    return results


Oracle = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _transformers_oracle(tmp_path: Path, hf: Any) -> Oracle:
    """transformers' ``hf``: its logits, then trained on the global batch (first gradients,
    the weights it saves)."""
    want_logits = _hf_logits(hf.eval())
    want_grads = _hf_train(hf)
    hf.save_pretrained(tmp_path / "hf-trained")
    return want_logits, want_grads, _read_dir(tmp_path / "hf-trained")


def _check_run(ours_dir: Path, results: list[Any], oracle: Oracle) -> None:
    """Each rank's :func:`_train_parallel` result, and what it saved in ``ours_dir``, equal
    transformers': loaded logits, first gradients, weights after STEPS steps, key by key."""
    want_logits, want_grads, theirs = oracle
    for found in results:
        assert_close_to_scale(found["logits"], want_logits, rel=1e-5, what="loaded logits")
        assert found["grads_are_dtensors"]
        assert sorted(found["grads"]) == sorted(want_grads)
        for key, want in want_grads.items():
            assert_close_to_scale(found["grads"][key], want, rel=1e-5, what=f"{key}.grad")
    ours = _read_dir(ours_dir)
    assert sorted(ours) == sorted(theirs)
    for key, want in theirs.items():
        assert_close_to_scale(ours[key], want, rel=1e-4, what=f"{key} after {STEPS} steps")


def test_dense_tp2_loads_trains_and_saves_like_transformers(tmp_path: Path) -> None:
    results = _check_training(tmp_path, _dense_hf_config(), {"dp_shard": 1, "tp": 2})
    wq = results[0]["local_shapes"]["layers.0.attention.wq.weight"]
    assert wq == (16, 16)  # this rank's 2 of 4 query heads (head_dim 8): a slice, not the whole
    config_json = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config_json["model_type"] == "qwen3" and config_json["head_dim"] == 8


# -- Qwen3-MoE -----------------------------------------------------------------------------
def _moe_hf_config(**changes: Any) -> Any:
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 40,
        "moe_intermediate_size": 12,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 16,
        "mlp_only_layers": [0],  # layer 0 a dense MLP, layer 1 the experts
        "tie_word_embeddings": False,
    }
    return transformers.Qwen3MoeConfig(**(fields | changes))


def test_moe_blocks_sit_where_transformers_puts_them(tmp_path: Path) -> None:
    hf_config = _moe_hf_config(num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3])
    hf_config.save_pretrained(tmp_path)
    theirs = [hasattr(layer.mlp, "experts") for layer in _hf_model(hf_config).model.layers]
    model = Qwen3.Config.from_hf(tmp_path).build()
    ours = [hasattr(layer.feed_forward, "experts") for layer in model.layers]
    assert ours == theirs == [False, True, False, False, False]


def test_load_hf_moe_one_process_gives_transformers_logits(tmp_path: Path) -> None:
    hf = _hf_model(_moe_hf_config(norm_topk_prob=True))
    hf.save_pretrained(tmp_path)
    config = Qwen3.Config.from_hf(tmp_path)
    assert (config.num_experts, config.top_k, config.moe_ffn_dim) == (4, 2, 12)
    assert config.route_norm and config.load_balance_coeff is None and config.aux_loss_coeff == 0
    model = config.build()
    load_hf(model, tmp_path)
    with torch.no_grad():
        assert_close_to_scale(model(TOKENS), _hf_logits(hf.eval()), rel=1e-5, what="logits")
    # routed experts, and nothing else, carry "experts" in their names
    experts = sorted(n for n, _ in model.named_parameters() if "experts" in n)
    assert experts == [f"layers.1.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]


def test_from_hf_reads_num_experts_as_the_hub_and_transformers_5_spell_it(
    tmp_path: Path,
) -> None:
    _moe_hf_config().save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["num_local_experts"] == 4  # what transformers 5.x writes
    written["num_experts"] = written.pop("num_local_experts")  # what the Hub's configs say
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert Qwen3.Config.from_hf(tmp_path).num_experts == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts": 8}, "num_experts: checkpoint 8, model 4"),
        ({"moe_intermediate_size": 20}, "moe_intermediate_size: checkpoint 20, model 12"),
    ],
    ids=["expert-count", "moe-intermediate-size"],
)
def test_load_hf_refuses_another_expert_layout_before_loading(
    tmp_path: Path, change: dict[str, int], message: str
) -> None:
    _hf_model(_moe_hf_config(**change)).save_pretrained(tmp_path / "hf")
    _moe_hf_config().save_pretrained(tmp_path / "cfg")
    model = Qwen3.Config.from_hf(tmp_path / "cfg").build()
    model.init_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        load_hf(model, tmp_path / "hf")
    assert message in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "degrees",
    [{"dp_shard": 2, "ep": 2}, {"dp_shard": 2}],
    ids=["ep2-experts-split", "fsdp2-experts-replicated"],  # 4 ranks: test_qwen3_layouts.py
)
def test_moe_loads_trains_and_saves_like_transformers(
    tmp_path: Path, degrees: dict[str, int]
) -> None:
    results = _check_training(tmp_path, _moe_hf_config(), degrees)
    ep = degrees.get("ep", 1)
    efsdp = degrees["dp_shard"] // ep if ep > 1 else 1  # with ep, FSDP shards experts on efsdp
    experts_per_rank = 4 // ep // efsdp
    for found in results:  # each rank read and holds only its own experts
        shape = found["local_shapes"]["layers.1.feed_forward.experts.w1"]
        assert shape == (experts_per_rank, 12, 16)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(loaded) is transformers.Qwen3MoeConfig
    assert (loaded.num_experts, loaded.mlp_only_layers) == (4, [0])


def _parallelize_refusals() -> dict[str, str]:
    """Each bad layout's error, with whether the model was left as it was."""
    torch.set_num_threads(1)
    experts = Qwen3.Config(
        vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=8, num_experts=3, top_k=1
    )
    heads = Qwen3.Config(vocab_size=VOCAB, dim=24, n_layers=1, n_heads=3, n_kv_heads=3)
    cases = {
        "experts-not-dividing-ep": (experts, {"ep": 2}),
        "heads-not-dividing-tp": (heads, {"tp": 2}),
    }
    found: dict[str, str] = {}
    for name, (config, degrees) in cases.items():
        model = config.build()
        try:
            parallelize_qwen3(model, ParallelDims(dp_shard=-1, **degrees))
        except ValueError as error:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            found[name] = f"{error} | untouched={untouched}"
    # plain meshes: a cp axis on qwen3-ref, a data-parallel axis that no FSDP covers
    plain: dict[str, tuple[Any, tuple[str, ...]]] = {
        "qwen3-cp-mesh": (Qwen3.Config(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2), ("cp",)),
        "llama-dp-mesh": (
            Llama.Config(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, ffn_dim=32),
            ("dp",),
        ),
    }
    for name, (config, names) in plain.items():
        model = config.build()
        try:
            model.parallelize(init_device_mesh("cpu", (2,), mesh_dim_names=names))
        except ValueError as error:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            found[name] = f"{error} | untouched={untouched}"
    return found


def test_parallelize_refuses_bad_layouts_on_every_rank_and_changes_nothing() -> None:
    for found in run_on_ranks(_parallelize_refusals, 2, timeout_s=240):
        assert (
            "num_experts=3 is not divisible by the size of mesh axis 'ep' (2)"
            in found["experts-not-dividing-ep"]
        )
        assert "n_heads (3)" in found["heads-not-dividing-tp"]
        assert "mesh axis 'cp' of size 2" in found["qwen3-cp-mesh"]
        assert "no context parallelism" in found["qwen3-cp-mesh"]
        assert "mesh axis 'dp' (2 ranks)" in found["llama-dp-mesh"]
        assert "average_gradients(model, mesh, 'dp')" in found["llama-dp-mesh"]
        assert all(message.endswith("untouched=True") for message in found.values())

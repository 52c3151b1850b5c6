"""qwen3-ref against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM: logits and training.

The oracle is transformers itself: a tiny model with random weights saved with
``save_pretrained`` (no download), run and trained in this process on the global batch.
The parallel side loads that directory with ``from_hf`` + ``load_hf`` on 2 ranks, trains
the same steps and writes itself back with ``save_hf``; the weights are compared key by
key in the Hub layout.
"""

from __future__ import annotations

import json
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
from hyper_parallel.dmodule.models.qwen3 import Qwen3
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import DTensor

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


def _hf_train(model: Any) -> None:
    """transformers' model, STEPS AdamW steps on the global batch in this process."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        logits: torch.Tensor = model(tokens).logits
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()


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
def _train_parallel(directory: str, out: str, degrees: dict[str, int]) -> dict[str, Any]:
    """from_hf on meta, the spec's parallelize_fn, load_hf, STEPS AdamW steps, save_hf."""
    torch.set_num_threads(1)
    dims = ParallelDims(**degrees)
    batch_rank = dims.get_mesh("batch").get_local_rank() if dims.dp > 1 else 0
    rows = slice(batch_rank * BATCH // dims.dp, (batch_rank + 1) * BATCH // dims.dp)
    with torch.device("meta"):
        model = Qwen3.Config.from_hf(directory).build()
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
        grads = [p.grad for p in model.parameters()]
        result.setdefault("grads_are_dtensors", True)
        result["grads_are_dtensors"] &= all(isinstance(g, DTensor) for g in grads)
        optimizer.step()
        optimizer.zero_grad()
    save_hf(model, out, max_shard_bytes=16 * 1024)
    return result


def _check_training(tmp_path: Path, hf_config: Any, degrees: dict[str, int]) -> list[Any]:
    hf = _hf_model(hf_config)
    hf.save_pretrained(tmp_path / "hf")
    want_logits = _hf_logits(hf.eval())
    results = run_on_ranks(
        _train_parallel, 2, str(tmp_path / "hf"), str(tmp_path / "ours"), degrees, timeout_s=240
    )
    for found in results:
        assert_close_to_scale(found["logits"], want_logits, rel=1e-5, what="loaded logits")
        assert found["grads_are_dtensors"]
    _hf_train(hf)
    hf.save_pretrained(tmp_path / "hf-trained")
    ours, theirs = _read_dir(tmp_path / "ours"), _read_dir(tmp_path / "hf-trained")
    assert sorted(ours) == sorted(theirs)
    for key, want in theirs.items():
        assert_close_to_scale(ours[key], want, rel=1e-4, what=f"{key} after {STEPS} steps")
    return results


def test_dense_tp2_loads_trains_and_saves_like_transformers(tmp_path: Path) -> None:
    results = _check_training(tmp_path, _dense_hf_config(), {"dp_shard": 1, "tp": 2})
    wq = results[0]["local_shapes"]["layers.0.attention.wq.weight"]
    assert wq == (16, 16)  # this rank's 2 of 4 query heads (head_dim 8): a slice, not the whole
    config_json = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config_json["model_type"] == "qwen3" and config_json["head_dim"] == 8

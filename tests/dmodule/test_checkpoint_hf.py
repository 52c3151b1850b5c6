"""Hugging Face interop: llama-ref loads and saves transformers Llama checkpoints, logits equal.

The oracle is transformers' own ``LlamaForCausalLM`` (a tiny one built from a
config, no download), in this process; the parallel side runs on 2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule.checkpoint import load_hf, save_hf
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import DTensor, init_device_mesh

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 7, 3, 0], [4, 4, 8, 1, 6, 2, 9, 5]])


def _hf_model(seed: int = 0) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF's init leaves norms at ones: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()  # type: ignore[no-any-return]


def _write_hf(directory: Path, *, sharded: bool) -> torch.Tensor:
    model = _hf_model()
    # a small max_shard_size forces several files and an index
    model.save_pretrained(directory, max_shard_size="20KB" if sharded else "10GB")
    return _hf_logits(model)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "indexed-shards"])
def test_load_hf_one_process_gives_transformers_logits(tmp_path: Path, sharded: bool) -> None:
    want = _write_hf(tmp_path, sharded=sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    model = Llama.Config.from_hf(tmp_path).build()
    load_hf(model, tmp_path)
    with torch.no_grad():
        assert_close_to_scale(model(TOKENS), want, rel=1e-5, what="logits")


def _load_hf_parallel(directory: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Llama.Config.from_hf(directory).build()
    model.parallelize(mesh)
    model.to_empty(device="cpu")
    model.init_weights()  # then overwritten: load_hf must fill every value
    load_hf(model, directory)
    with torch.no_grad():
        logits = model(TOKENS)
    assert isinstance(logits, DTensor)
    local = {k: v.to_local().shape for k, v in model.state_dict().items()}
    return {"logits": logits.full_tensor(), "local_shapes": local}


def test_load_hf_on_two_ranks_reads_slices_and_gives_transformers_logits(tmp_path: Path) -> None:
    want = _write_hf(tmp_path, sharded=True)
    full_shapes = {
        k: v.shape for k, v in Llama.Config.from_hf(tmp_path).build().state_dict().items()
    }
    for found in run_on_ranks(_load_hf_parallel, 2, str(tmp_path)):
        assert_close_to_scale(found["logits"], want, rel=1e-5, what="logits")
        wq = "layers.0.attention.wq.weight"
        assert found["local_shapes"][wq][0] * 2 == full_shapes[wq][0]  # sharded, not full


def _save_hf_parallel(directory: str) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(3)
    model = _ref_config().build()
    model.init_weights()
    model.parallelize(mesh)
    save_hf(model, directory, max_shard_bytes=16 * 1024)
    with torch.no_grad():
        logits = model(TOKENS)
    assert isinstance(logits, DTensor)
    return logits.full_tensor()


def _ref_config() -> Llama.Config:
    return Llama.Config(
        vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, max_seq_len=16
    )


def test_save_hf_on_two_ranks_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    ours = run_on_ranks(_save_hf_parallel, 2, str(tmp_path))[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # bounded shards
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert_close_to_scale(_hf_logits(hf), ours, rel=1e-5, what="logits")
    torch.manual_seed(3)
    one = _ref_config().build()
    one.init_weights()
    with torch.no_grad():
        assert_close_to_scale(one(TOKENS), ours, rel=1e-5, what="one-process logits")


def test_config_from_hf_refuses_what_llama_ref_does_not_compute(tmp_path: Path) -> None:
    config = _hf_model().config
    config.attention_bias = True
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_bias=True"):
        Llama.Config.from_hf(tmp_path)


def test_load_hf_names_missing_and_mis_shaped_keys_before_loading(tmp_path: Path) -> None:
    _write_hf(tmp_path, sharded=False)
    model = Llama.Config.from_hf(tmp_path).replace(n_layers=3, ffn_dim=48).build()
    model.init_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        load_hf(model, tmp_path)
    assert "model.layers.2.self_attn.q_proj.weight" in str(info.value)
    assert "model.layers.0.mlp.gate_proj.weight: file (40, 16), model (48, 16)" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _RenameOnly:
    """An adapter of a model that is not llama-ref: renames keys, knows no config.json."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"m.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("m."): v for k, v in hf_state_dict.items()}


def test_save_hf_takes_config_json_from_the_adapter_not_from_the_model_class(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"Linear .*_RenameOnly has no hf_config\(\).*config="):
        save_hf(model, tmp_path / "none", adapter=_RenameOnly())
    assert not (tmp_path / "none" / "config.json").exists()
    save_hf(model, tmp_path / "given", adapter=_RenameOnly(), config={"model_type": "toy"})
    assert json.loads((tmp_path / "given" / "config.json").read_text()) == {"model_type": "toy"}


def test_checkpoint_package_does_not_import_the_reference_models() -> None:
    import ast

    import hyper_parallel.dmodule.checkpoint as checkpoint

    for path in Path(checkpoint.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("hyper_parallel.dmodule.models"), (
                    f"{path.name} imports {node.module}: ask the ModelSpec's adapter instead"
                )


@pytest.mark.parametrize("cut", ["in-the-header", "in-the-tensors"])
def test_load_hf_of_a_truncated_safetensors_file_names_the_file(tmp_path: Path, cut: str) -> None:
    _write_hf(tmp_path, sharded=False)
    model = Llama.Config.from_hf(tmp_path).build()
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    kept = 6 if cut == "in-the-header" else len(data) - 1000
    file.write_bytes(data[:kept])
    with pytest.raises(ValueError, match=rf"cannot read .*model.safetensors \({kept} bytes\)"):
        load_hf(model, tmp_path)

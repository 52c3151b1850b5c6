"""The published Llama 3.x and Qwen3 models as flavors, against their ``config.json`` and transformers.

Oracles: the published ``config.json`` of each model (written out below, the fields that
shape the model), the parameter counts published with them, and transformers' own model
built on the meta device from the same ``config.json``. Tied embeddings and Llama 3.1's
``llama3`` RoPE scaling are checked against transformers' numbers on tiny random models
(logits, inverse frequencies, and a ``save_hf``/``load_hf`` round trip). Everything runs
on one process; the big models only on the meta device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule.checkpoint import load_hf, save_hf
from hyper_parallel.dmodule.layers import RopeScaling, rope_inv_freq, rotary_tables
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def _llama_scaling(factor: float) -> dict[str, Any]:
    return {
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


def _llama(hidden: int, layers: int, heads: int, ffn: int, factor: float, tied: bool) -> Any:
    return _LLAMA3 | {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": ffn,
        "rope_scaling": _llama_scaling(factor),
        "tie_word_embeddings": tied,
    }


_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
}


def _qwen3(hidden: int, layers: int, heads: int, kv: int, ffn: int, tied: bool) -> Any:
    return _QWEN3 | {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "tie_word_embeddings": tied,
        "max_window_layers": layers,
    }


def _qwen3_moe(hidden: int, layers: int, heads: int, ffn: int, moe_ffn: int) -> Any:
    return _qwen3(hidden, layers, heads, 4, ffn, False) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": moe_ffn,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


#: (model, flavor) -> (the published config.json's shaping fields, the published count)
PUBLISHED: dict[tuple[str, str], tuple[dict[str, Any], int]] = {
    ("llama-ref", "1B"): (_llama(2048, 16, 32, 8192, 32.0, True), 1_235_814_400),
    ("llama-ref", "3B"): (_llama(3072, 28, 24, 8192, 32.0, True), 3_212_749_824),
    ("llama-ref", "8B"): (_llama(4096, 32, 32, 14336, 8.0, False), 8_030_261_248),
    ("llama-ref", "70B"): (_llama(8192, 80, 64, 28672, 8.0, False), 70_553_706_496),
    ("llama-ref", "405B"): (_llama(16384, 126, 128, 53248, 8.0, False), 405_853_388_800),
    ("qwen3-ref", "0.6B"): (_qwen3(1024, 28, 16, 8, 3072, True), 596_049_920),
    ("qwen3-ref", "1.7B"): (_qwen3(2048, 28, 16, 8, 6144, True), 1_720_574_976),
    ("qwen3-ref", "4B"): (_qwen3(2560, 36, 32, 8, 9728, True), 4_022_468_096),
    ("qwen3-ref", "8B"): (_qwen3(4096, 36, 32, 8, 12288, False), 8_190_735_360),
    ("qwen3-ref", "14B"): (_qwen3(5120, 40, 40, 8, 17408, False), 14_768_307_200),
    ("qwen3-ref", "32B"): (_qwen3(5120, 64, 64, 8, 25600, False), 32_762_123_264),
    ("qwen3-ref", "30B-A3B"): (_qwen3_moe(2048, 48, 32, 6144, 768), 30_532_122_624),
    ("qwen3-ref", "235B-A22B"): (_qwen3_moe(4096, 94, 64, 12288, 1536), 235_093_634_560),
}
#: transformers' meta build of these walks 126 / 94 layers of Python: compared with the
#: published count instead (ours is, below), to keep the test fast
_SLOW_IN_TRANSFORMERS = {("llama-ref", "405B"), ("qwen3-ref", "235B-A22B")}

_CONFIG_CLASSES: dict[str, Any] = {"llama-ref": Llama.Config, "qwen3-ref": Qwen3.Config}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def _transformers_model(data: dict[str, Any]) -> Any:
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("key", list(PUBLISHED), ids=[f"{m}-{f}" for m, f in PUBLISHED])
def test_flavor_is_the_published_config_with_its_parameter_count(
    key: tuple[str, str], tmp_path: Path
) -> None:
    model_name, flavor = key
    published, count = PUBLISHED[key]
    config = get_spec(model_name).config(flavor)
    # field for field: from_hf of the published config.json gives the flavor
    assert _CONFIG_CLASSES[model_name].from_hf(_write(tmp_path, published)) == config
    with torch.device("meta"):
        ours = config.build()
    assert _count(ours) == count
    if key not in _SLOW_IN_TRANSFORMERS:
        assert _count(_transformers_model(published)) == count
    tied = published["tie_word_embeddings"]
    assert (ours.output.weight is ours.tok_embeddings.weight) is tied


@pytest.mark.parametrize("key", list(PUBLISHED), ids=[f"{m}-{f}" for m, f in PUBLISHED])
def test_flavor_writes_the_published_config_json_fields(key: tuple[str, str]) -> None:
    model_name, flavor = key
    published, _ = PUBLISHED[key]
    spec = get_spec(model_name)
    config = spec.config(flavor)
    assert spec.state_dict_adapter is not None
    written = spec.state_dict_adapter(config).hf_config()
    rope = written["rope_parameters"]
    assert rope["rope_theta"] == published["rope_theta"]
    if published.get("rope_scaling"):
        assert {k: rope[k] for k in published["rope_scaling"]} == published["rope_scaling"]
    else:
        assert rope["rope_type"] == "default"
    shaping = {
        k: v
        for k, v in published.items()
        if k not in ("rope_theta", "rope_scaling", "sliding_window", "router_aux_loss_coef")
        and k not in ("max_window_layers",)
    }
    assert {k: written.get(k) for k in shaping} == shaping


def test_small_flavors_stay() -> None:
    assert {"debug", "small"} <= set(get_spec("llama-ref").flavors)
    assert {"debug", "debug-moe", "small", "small-moe"} <= set(get_spec("qwen3-ref").flavors)


def test_an_unknown_flavor_lists_the_flavors() -> None:
    with pytest.raises(LookupError, match="no flavor '7B'") as error:
        get_spec("llama-ref").config("7B")
    assert "'405B'" in str(error.value) and "'debug'" in str(error.value)


# -- Llama 3.1's llama3 RoPE scaling and tied embeddings against transformers ---------------
_TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500.0,
    # head_dim 16, theta 500: wavelengths 6.3 ... 1436, so with 64 / 4 = 16 and 64 / 1 = 64
    # every band of the scaling is used (kept, interpolated, slowed by the factor)
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
}


def _hf_tiny(data: dict[str, Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**({"model_type": "llama"} | data))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms off ones, so that a norm read from the wrong key shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_llama3_inv_freq_equals_transformers() -> None:
    hf = _hf_tiny(_TINY_LLAMA)
    want = hf.model.rotary_emb.inv_freq
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=64)
    found = rope_inv_freq(16, 500.0, scaling=scaling)
    plain = rope_inv_freq(16, 500.0)
    kept, slowed = found == plain, torch.isclose(found, plain / 8)
    assert kept.any() and slowed.any() and not (kept | slowed).all()  # all three bands
    torch.testing.assert_close(found, want, rtol=0, atol=0)
    # the tables: transformers' cos/sin at every position
    cos, sin = rotary_tables(16, 128, 500.0, scaling=scaling)
    positions = torch.arange(128)[None]
    want_cos, want_sin = hf.model.rotary_emb(torch.zeros(1, 128, 64), positions)
    torch.testing.assert_close(torch.cat([cos, cos], -1), want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([sin, sin], -1), want_sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "data",
    [
        _TINY_LLAMA,
        _TINY_LLAMA | {"tie_word_embeddings": False, "rope_scaling": None},
        {
            "model_type": "qwen3",
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 40,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 16,
            "tie_word_embeddings": True,
        },
    ],
    ids=["llama-tied-llama3", "llama-untied-default", "qwen3-tied"],
)
def test_hf_round_trip_gives_transformers_logits(data: dict[str, Any], tmp_path: Path) -> None:
    """transformers' checkpoint -> from_hf + load_hf: its logits; save_hf -> transformers
    loads the same logits, with no lm_head.weight when tied."""
    hf = _hf_tiny(data)
    hf.save_pretrained(tmp_path / "theirs")
    cls = Qwen3.Config if data.get("model_type") == "qwen3" else Llama.Config
    config = cls.from_hf(tmp_path / "theirs")
    assert config.tie_word_embeddings is data["tie_word_embeddings"]
    with torch.device("meta"):
        ours = config.build()
    ours.to_empty(device="cpu")
    ours.init_weights()
    load_hf(ours, tmp_path / "theirs")
    # 128 positions: past original_max_position_embeddings, where the scaling matters
    seq = data["max_position_embeddings"]
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        assert_close_to_scale(ours(tokens), want, rel=1e-5, what="loaded logits")
    save_hf(ours, tmp_path / "ours")
    saved = set()
    for file in (tmp_path / "ours").glob("*.safetensors"):
        import safetensors

        with safetensors.safe_open(str(file), framework="pt") as f:
            saved |= set(f.keys())
    assert ("lm_head.weight" in saved) is not data["tie_word_embeddings"]
    back = type(hf).from_pretrained(tmp_path / "ours").eval()
    assert back.config.tie_word_embeddings is data["tie_word_embeddings"]
    with torch.no_grad():
        assert_close_to_scale(back(tokens).logits, want, rel=1e-5, what="saved logits")


def test_tied_flops_count_the_output_projection() -> None:
    tied = Llama.Config(tie_word_embeddings=True)
    untied = Llama.Config()
    n_tied, f_tied = tied.get_nparams_and_flops(tied.build(), 16)
    n_untied, f_untied = untied.get_nparams_and_flops(untied.build(), 16)
    assert n_untied - n_tied == tied.vocab_size * tied.dim
    assert f_tied == f_untied  # the same matmuls, one weight fewer


def test_tied_embeddings_refuse_pipeline_stages() -> None:
    from hyper_parallel.dmodule import ParallelDims

    with torch.device("meta"):
        model = Llama.Config(n_layers=4, tie_word_embeddings=True).build()
    spec = get_spec("llama-ref")
    assert spec.pipelining_fn is not None
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True .* pp=2"):
        spec.pipelining_fn(model, ParallelDims(pp=2, world_size=2), {})


# -- from_hf of a broken config.json names the file and the field -----------------------------
@pytest.mark.parametrize("cls", [Llama.Config, Qwen3.Config], ids=["llama", "qwen3"])
def test_from_hf_names_the_file_and_the_missing_field(cls: Any, tmp_path: Path) -> None:
    published = dict(PUBLISHED[("llama-ref", "1B")][0] if cls is Llama.Config else _QWEN3)
    published |= {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    published |= {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 16}
    del published["vocab_size"]
    path = _write(tmp_path, published) / "config.json"
    with pytest.raises(ValueError, match="missing field 'vocab_size'") as error:
        cls.from_hf(tmp_path)
    assert str(path) in str(error.value)
    published["vocab_size"] = "many"
    _write(tmp_path, published)
    with pytest.raises(ValueError, match=r"field 'vocab_size': expected an int, found 'many'"):
        cls.from_hf(tmp_path)


@pytest.mark.parametrize("cls", [Llama.Config, Qwen3.Config], ids=["llama", "qwen3"])
def test_from_hf_names_the_file_that_is_not_json(cls: Any, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64,\n "vocab_size": }')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON: .* line 2") as error:
        cls.from_hf(tmp_path)
    assert str(tmp_path) in str(error.value)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        cls.from_hf(tmp_path / "nowhere")


# -- the registry knows the built-in models; a meta build computes nothing ----------------------
_FRESH = """
import sys
import torch
from hyper_parallel.dmodule import get_spec
from hyper_parallel.dmodule.model_spec import _default_registry
assert "hyper_parallel.dmodule.models.llama" not in sys.modules, "imported before asked"
print(_default_registry.names())
llama = get_spec("llama-ref").config("405B")
print(llama.n_layers, get_spec("qwen3-ref").config("0.6B").tie_word_embeddings)
with torch.device("meta"):
    get_spec("llama-ref").config("1B").build()
    get_spec("qwen3-ref").config("debug").build()
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_get_spec_knows_the_built_in_models_and_meta_builds_import_no_dynamo() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    names, counts, imported = done.stdout.strip().splitlines()
    assert names == "['llama-ref', 'qwen3-ref']"
    assert counts == "126 True"
    # torch.arange/empty_like on meta run torch's Python references, which import torch._dynamo
    # (seconds): the RoPE tables are not computed there
    assert imported == "[]"


def test_load_hf_refuses_an_untied_checkpoint_into_a_tied_model(tmp_path: Path) -> None:
    untied = _TINY_LLAMA | {"tie_word_embeddings": False}
    _hf_tiny(untied).save_pretrained(tmp_path)
    model = Llama.Config.from_hf(tmp_path).replace(tie_word_embeddings=True).build()
    model.init_weights()  # built states are uninitialised memory: NaN would never equal itself
    before = model.tok_embeddings.weight.detach().clone()
    with pytest.raises(ValueError, match=r"tie_word_embeddings: checkpoint False .* model True"):
        load_hf(model, tmp_path)
    assert torch.equal(model.tok_embeddings.weight, before)  # nothing was loaded


def test_from_hf_takes_absent_or_null_optional_fields(tmp_path: Path) -> None:
    """Llama: no num_key_value_heads (or null) is as many as the query heads, as transformers'
    LlamaConfig; a null head_dim is dim / heads (it was refused as "expected an int")."""
    llama = {k: v for k, v in _TINY_LLAMA.items() if k != "num_key_value_heads"}
    theirs = transformers.LlamaConfig(**llama)
    assert Llama.Config.from_hf(_write(tmp_path, llama)).n_kv_heads == theirs.num_key_value_heads
    llama |= {"num_key_value_heads": None, "head_dim": None}
    assert Llama.Config.from_hf(_write(tmp_path, llama)).n_kv_heads == theirs.num_key_value_heads
    data = dict(_QWEN3) | {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    data |= {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": None}
    data |= {"tie_word_embeddings": False}
    assert Qwen3.Config.from_hf(_write(tmp_path, data)).head_dim == 16

"""The reference Llama and Hugging Face's ``LlamaForCausalLM``: config fields and state-dict keys.

llama-ref computes what ``transformers.LlamaForCausalLM`` computes (RMSNorm in
float32, rotate-half RoPE, SwiGLU, causal GQA with ``head_dim ** -0.5`` scaling),
so the map between them renames keys and leaves values as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.layers.rope import RopeScaling
from hyper_parallel.dmodule.models._hf_keys import HFFields, KeyMap, tie_problems

# llama.py imports this file (its Config's from_hf, its spec's adapter); this file imports
# no model: it reads the fields below, which Llama.Config has.
_C = TypeVar("_C")


class LlamaFields(Protocol):
    """The fields of ``Llama.Config`` that ``config.json`` describes."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int | None: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> RopeScaling | None: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def use_rope(self) -> bool: ...


__all__ = ["LlamaFields", "LlamaStateDictAdapter", "llama_config_from_hf", "llama_config_to_hf"]

# (our FQN pattern, Hugging Face key pattern); {i} is a layer index
_KEYS = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)


_KEY_MAP = KeyMap(_KEYS, "Llama")


class LlamaStateDictAdapter:
    """llama-ref FQNs ⇄ ``LlamaForCausalLM`` keys; values pass through unchanged.

    Example::

        >>> adapter = LlamaStateDictAdapter(Llama.Config())
        >>> list(adapter.to_hf({"layers.0.attention.wq.weight": 1}))
        ['model.layers.0.self_attn.q_proj.weight']
    """

    def __init__(self, config: LlamaFields) -> None:
        self.config = config

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our FQNs to Hugging Face keys; tied embeddings have no ``lm_head.weight`` (as
        transformers writes them: the output is the embedding)."""
        tied = self.config.tie_word_embeddings
        return {
            _KEY_MAP.to_hf(k): v
            for k, v in state_dict.items()
            if not (tied and k == "output.weight")
        }

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {_KEY_MAP.from_hf(k): v for k, v in hf_state_dict.items()}

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the model (what ``save_hf`` writes by default)."""
        return llama_config_to_hf(self.config)

    def hf_config_problems(self, hf_config: dict[str, Any]) -> list[str]:
        """Why a checkpoint's ``config.json`` cannot load into the model (``load_hf`` refuses)."""
        return tie_problems(hf_config, self.config.tie_word_embeddings)


def llama_config_from_hf(cls: Callable[..., _C], directory: str | os.PathLike[str]) -> _C:
    """``Llama.Config.from_hf``: a Config from a transformers Llama ``config.json``.

    Reads ``tie_word_embeddings`` and Llama 3.1's ``llama3`` RoPE scaling (``rope_scaling``
    as the Hub writes it, or transformers 5's ``rope_parameters``). Fields llama-ref does
    not implement (biases, another activation, another RoPE scaling, a head_dim other than
    dim / n_heads) raise rather than being silently dropped; a missing or mistyped field,
    or a file that is not JSON, raises naming the file and the field.
    """
    hf = HFFields.read(directory)
    where = f"Llama.Config.from_hf({os.fspath(directory)!r})"
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: expected model_type 'llama', found {hf.get('model_type')!r}")
    rope = _rope_section(hf)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    if rope_type not in ("default", "llama3"):
        problems["rope_type"] = (rope_type, "default' or 'llama3")
    dim, n_heads = hf.int("hidden_size"), hf.int("num_attention_heads")
    head_dim = hf.get("head_dim") or dim // max(n_heads, 1)
    problems["head_dim"] = (head_dim, dim // max(n_heads, 1))
    bad = [
        f"{k}={found!r} (supported: {want!r})"
        for k, (found, want) in problems.items()
        if found != want
    ]
    if bad:
        raise ValueError(f"{where}: llama-ref does not implement {', '.join(bad)}")
    try:
        return _config(cls, hf, rope, rope_type, dim, n_heads)
    except ConfigError as error:  # a value that type-checks but makes no model: name the file
        raise ValueError(f"{where}: {hf.path}: {error}") from None


def _config(
    cls: Callable[..., _C],
    hf: HFFields,
    rope: dict[str, Any],
    rope_type: str,
    dim: int,
    n_heads: int,
) -> _C:
    scaling = None
    if rope_type == "llama3":
        section = HFFields(rope, f"{hf.path}: rope_scaling")
        scaling = RopeScaling(
            factor=section.float("factor"),
            low_freq_factor=section.float("low_freq_factor"),
            high_freq_factor=section.float("high_freq_factor"),
            original_max_position_embeddings=section.int("original_max_position_embeddings"),
        )
    return cls(
        vocab_size=hf.int("vocab_size"),
        dim=dim,
        n_layers=hf.int("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.opt_int("num_key_value_heads") or n_heads,
        ffn_dim=hf.int("intermediate_size"),
        max_seq_len=hf.int("max_position_embeddings", 2048),
        norm_eps=hf.float("rms_norm_eps", 1e-6),
        rope_theta=HFFields(rope, hf.path).float("rope_theta", hf.float("rope_theta", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=hf.bool("tie_word_embeddings", False),
    )


def _rope_section(hf: HFFields) -> dict[str, Any]:
    """RoPE's fields: transformers 5's ``rope_parameters``, else the Hub's ``rope_scaling``."""
    for key in ("rope_parameters", "rope_scaling"):
        section = hf.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ValueError(
                f"from_hf: {hf.path}: field {key!r}: expected an object, found {section!r}"
            )
        return section
    return {}


def llama_config_to_hf(config: LlamaFields) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` computing what ``config`` does.

    Example::

        >>> llama_config_to_hf(Llama.Config(dim=32))["hidden_size"]
        32
    """
    if not config.use_rope:
        raise ValueError(
            "llama_config_to_hf: LlamaForCausalLM always applies RoPE (use_rope=False)"
        )
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope = {"rope_theta": config.rope_theta, **config.rope_scaling.to_hf()}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": config.dim // config.n_heads,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "float32",
    }

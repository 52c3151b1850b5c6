"""qwen3-ref and transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: config and keys.

qwen3-ref computes what transformers computes (RMSNorm in float32, q/k RMSNorm per head
before rotate-half RoPE, causal GQA scaled by ``head_dim ** -0.5``, SwiGLU, a softmax
top-k router in float32), so the map renames keys and, for the routed experts, stacks
the Hub's per-expert matrices: our ``experts.w1 [E, hidden, dim]`` is the Hub's
``mlp.experts.{e}.gate_proj.weight`` for ``e`` in ``0..E-1`` (``w3``: ``up_proj``,
``w2``: ``down_proj``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.models._hf_keys import HFFields, KeyMap, tie_problems

# qwen3.py imports this file (its Config's from_hf, its spec's adapter); this file imports
# no model: it reads the fields below, which Qwen3.Config has.
_C = TypeVar("_C")


class Qwen3Fields(Protocol):
    """The fields of ``Qwen3.Config`` that ``config.json`` describes."""

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
    def head_dim(self) -> int | None: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def moe_ffn_dim(self) -> int: ...
    @property
    def decoder_sparse_step(self) -> int: ...
    @property
    def mlp_only_layers(self) -> tuple[int, ...]: ...
    @property
    def route_norm(self) -> bool: ...


__all__ = ["Qwen3Fields", "Qwen3StateDictAdapter", "qwen3_config_from_hf", "qwen3_config_to_hf"]

# (our FQN pattern, Hugging Face key pattern); {i} is a layer index
_KEYS = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.router.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
# routed experts: one of our tensors is the Hub's E matrices stacked along dim 0; {e} an expert
_STACKED = (
    ("layers.{i}.feed_forward.experts.w1", "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"),
    ("layers.{i}.feed_forward.experts.w3", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
    ("layers.{i}.feed_forward.experts.w2", "model.layers.{i}.mlp.experts.{e}.down_proj.weight"),
)
_KEY_MAP = KeyMap(_KEYS, "Qwen3")
_STACK_MAP = KeyMap(_STACKED, "Qwen3")


def _is_stacked(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".experts." in fqn


class Qwen3StateDictAdapter:
    """qwen3-ref FQNs ⇄ transformers Qwen3 / Qwen3-MoE keys (experts stacked ⇄ one per expert).

    Example::

        >>> adapter = Qwen3StateDictAdapter(Qwen3.Config(num_experts=2))
        >>> sorted(adapter.to_hf({"layers.0.feed_forward.experts.w1": torch.zeros(2, 3, 4)}))
        ['model.layers.0.mlp.experts.0.gate_proj.weight', 'model.layers.0.mlp.experts.1.gate_proj.weight']
    """

    def __init__(self, config: Qwen3Fields) -> None:
        self.config = config

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Our FQNs to Hugging Face keys; stacked experts split into one tensor per expert;
        no ``lm_head.weight`` with tied embeddings."""
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key == "output.weight" and self.config.tie_word_embeddings:
                continue  # tied: transformers writes no lm_head.weight (it is the embedding)
            if _is_stacked(key):
                for e, hf_key in enumerate(self.hf_stacks([key])[key]):
                    out[hf_key] = value[e]
            else:
                out[_KEY_MAP.to_hf(key)] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face keys to our FQNs; the per-expert tensors stacked in expert order."""
        out: dict[str, Any] = {}
        experts: dict[str, dict[int, Any]] = {}
        for key, value in hf_state_dict.items():
            if ".mlp.experts." in key:
                expert = int(key.split(".mlp.experts.")[1].split(".")[0])
                experts.setdefault(_STACK_MAP.from_hf(key), {})[expert] = value
            else:
                out[_KEY_MAP.from_hf(key)] = value
        for fqn, by_expert in experts.items():
            if sorted(by_expert) != list(range(self.config.num_experts)):
                raise KeyError(
                    f"Qwen3StateDictAdapter.from_hf: {fqn} needs experts 0..."
                    f"{self.config.num_experts - 1}, found {sorted(by_expert)}"
                )
            out[fqn] = torch.stack([by_expert[e] for e in range(self.config.num_experts)])
        return out

    def hf_stacks(self, fqns: list[str]) -> dict[str, list[str]]:
        """Of ``fqns``, those stacking several Hugging Face tensors (dim 0), with their keys.

        ``load_hf`` reads only the experts a rank holds; ``save_hf`` writes each one.
        """
        stacks: dict[str, list[str]] = {}
        for fqn in fqns:
            if _is_stacked(fqn):
                pattern = _STACK_MAP.to_hf(fqn)
                stacks[fqn] = [
                    pattern.replace("{e}", str(e)) for e in range(self.config.num_experts)
                ]
        return stacks

    def hf_config_problems(self, hf_config: dict[str, Any]) -> list[str]:
        """How a checkpoint's ``config.json`` differs from the model's in the expert layout."""
        cfg = self.config
        found = {
            "num_experts": _num_experts(hf_config),
            "moe_intermediate_size": hf_config.get("moe_intermediate_size"),
        }
        wanted = {"num_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_ffn_dim}
        tie = tie_problems(hf_config, cfg.tie_word_embeddings)
        if not cfg.num_experts:
            return tie + (
                []
                if not found["num_experts"]
                else [f"num_experts: checkpoint {found['num_experts']}, model 0 (dense)"]
            )
        return tie + [
            f"{key}: checkpoint {found[key]}, model {wanted[key]}"
            for key in found
            if found[key] != wanted[key]
        ]

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the model (what ``save_hf`` writes by default)."""
        return qwen3_config_to_hf(self.config)


def _num_experts(hf: dict[str, Any]) -> int:
    # transformers 5.x writes num_local_experts; the Hub's configs say num_experts
    return int(hf.get("num_local_experts", hf.get("num_experts")) or 0)


def qwen3_config_from_hf(cls: Callable[..., _C], directory: str | os.PathLike[str]) -> _C:
    """``Qwen3.Config.from_hf``: a Config from a ``Qwen3Config`` or ``Qwen3MoeConfig`` json.

    Reads ``tie_word_embeddings``. Fields qwen3-ref does not implement (biases, another
    activation, RoPE scaling, sliding windows, transformers' cross-layer auxiliary loss)
    raise rather than being silently dropped; a missing or mistyped field, or a file that
    is not JSON, raises naming the file and the field.
    """
    hf = HFFields.read(directory)
    where = f"Qwen3.Config.from_hf({os.fspath(directory)!r})"
    model_type = hf.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"{where}: expected model_type 'qwen3' or 'qwen3_moe', found {model_type!r}"
        )
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", "default"))
    problems = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "rope_type": (rope_type, "default"),
        "use_sliding_window": (hf.get("use_sliding_window", False), False),
        # transformers pools the router logits of every layer into one loss; ours is per layer
        "output_router_logits": (hf.get("output_router_logits", False), False),
    }
    bad = [
        f"{k}={found!r} (supported: {want!r})"
        for k, (found, want) in problems.items()
        if found != want
    ]
    if bad:
        raise ValueError(f"{where}: qwen3-ref does not implement {', '.join(bad)}")
    dim, n_heads = hf.int("hidden_size"), hf.int("num_attention_heads")
    num_experts = _num_experts(hf.data) if model_type == "qwen3_moe" else 0
    moe: dict[str, Any] = {}
    if num_experts:
        mlp_only = hf.get("mlp_only_layers") or ()
        if not isinstance(mlp_only, (list, tuple)):
            raise ValueError(
                f"from_hf: {hf.path}: field 'mlp_only_layers': expected a list of layer "
                f"indices, found {mlp_only!r}"
            )
        moe = {
            "num_experts": num_experts,
            "top_k": hf.int("num_experts_per_tok"),
            "moe_ffn_dim": hf.int("moe_intermediate_size"),
            "decoder_sparse_step": hf.int("decoder_sparse_step", 1),
            "mlp_only_layers": tuple(int(i) for i in mlp_only),
            "route_norm": hf.bool("norm_topk_prob", False),
        }
    try:
        return cls(
            vocab_size=hf.int("vocab_size"),
            dim=dim,
            n_layers=hf.int("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=hf.opt_int("num_key_value_heads") or n_heads,
            head_dim=hf.opt_int("head_dim") or dim // max(n_heads, 1),
            ffn_dim=hf.int("intermediate_size"),
            max_seq_len=hf.int("max_position_embeddings", 2048),
            norm_eps=hf.float("rms_norm_eps", 1e-6),
            rope_theta=HFFields(rope, hf.path).float("rope_theta", hf.float("rope_theta", 1e4)),
            tie_word_embeddings=hf.bool("tie_word_embeddings", False),
            **moe,
        )
    except ConfigError as error:  # a value that type-checks but makes no model: name the file
        raise ValueError(f"{where}: {hf.path}: {error}") from None


def qwen3_config_to_hf(config: Qwen3Fields) -> dict[str, Any]:
    """The ``config.json`` of the transformers model computing what ``config`` does.

    ``Qwen3ForCausalLM`` when ``num_experts == 0``, else ``Qwen3MoeForCausalLM``.

    Example::

        >>> qwen3_config_to_hf(Qwen3.Config(num_experts=4))["model_type"]
        'qwen3_moe'
    """
    head_dim = config.head_dim if config.head_dim is not None else config.dim // config.n_heads
    out: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads or config.n_heads,
        "head_dim": head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if config.num_experts:
        out |= {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.top_k,
            "moe_intermediate_size": config.moe_ffn_dim,
            "decoder_sparse_step": config.decoder_sparse_step,
            "mlp_only_layers": list(config.mlp_only_layers),
            "norm_topk_prob": config.route_norm,
            "output_router_logits": False,
        }
    return out

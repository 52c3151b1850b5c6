"""qwen3-ref's plan in ``models/qwen3_sharding.py``: the layers' presets part by part, in order.

The oracle for the layouts is the layers' own presets (``Linear.Config.colwise``,
``Embedding.Config.vocab_parallel``, ``block_sharding``, the norm presets) and transformers'
rule for where the MoE blocks sit; values under the plan are checked against transformers by
``test_qwen3.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from hyper_parallel.dmodule.layers import FeedForward, Linear, MoE, RMSNorm, block_sharding
from hyper_parallel.dmodule.models import qwen3_sharding
from hyper_parallel.dmodule.models.qwen3 import Qwen3, parallelize_qwen3


def _tiny(**fields: Any) -> Qwen3.Config:
    return Qwen3.Config(vocab_size=32, dim=16, n_layers=3, n_heads=4, head_dim=8, **fields)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sp"])
def test_attention_carries_the_block_preset_and_its_norms_are_replicated(
    sequence_parallel: bool,
) -> None:
    model = _tiny(sequence_parallel=sequence_parallel).build()
    attention = model.layers[0].attention
    want = block_sharding(
        sequence_parallel=sequence_parallel, replicated_states=("rope_cos", "rope_sin")
    )
    assert attention.sharding_config == want
    assert (
        attention.wq.sharding_config
        == Linear.Config.colwise(1, 1, states_only=True).sharding_config
    )
    assert (
        attention.wo.sharding_config
        == Linear.Config.rowwise(1, 1, states_only=True).sharding_config
    )
    # per-head norms act on the local heads: replicated weights, no boundary of their own
    assert attention.q_norm.sharding_config == RMSNorm.Config(dim=8).sharding_config
    assert attention.q_norm.weight.shape == (8,)


def test_feed_forward_is_moe_exactly_where_transformers_puts_experts() -> None:
    cfg = _tiny(num_experts=4, top_k=2, decoder_sparse_step=1, mlp_only_layers=(1,))
    kinds = [type(layer.feed_forward) for layer in cfg.build().layers]
    assert kinds == [MoE, FeedForward, MoE]
    assert [type(layer.feed_forward) for layer in _tiny().build().layers] == [FeedForward] * 3


def test_parallelize_qwen3_runs_tp_then_ac_then_compile_then_fsdp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    for step in ("apply_tp", "apply_compile", "apply_fsdp"):
        monkeypatch.setattr(
            qwen3_sharding, step, lambda model, *args, _step=step, **_: calls.append(_step)
        )
    monkeypatch.setattr(
        qwen3_sharding,
        "apply_activation_checkpointing",
        lambda blocks, mode: calls.append(f"ac:{mode}"),
    )
    model = _tiny().build()
    mesh: Any = _FakeMesh()
    assert parallelize_qwen3(model, mesh, {"activation_checkpoint": "full"}) is model
    assert calls == ["apply_tp", "ac:full", "apply_compile", "apply_fsdp"]


class _FakeMesh:
    """Just the names parallelize_qwen3 reads to choose its steps."""

    mesh_dim_names = ("tp",)

"""qwen3-ref's plan in ``models/qwen3_sharding.py``: the layers' presets part by part, in order.

The oracle for the layouts is the layers' own presets (``Linear.Config.colwise``,
``Embedding.Config.vocab_parallel``, ``block_sharding``, the norm presets) and transformers'
rule for where the MoE blocks sit; values under the plan are checked against transformers by
``test_qwen3.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hyper_parallel.dmodule.layers import FeedForward, Linear, MoE, RMSNorm, block_sharding
from hyper_parallel.dmodule.models import qwen3_sharding
from hyper_parallel.dmodule.models.qwen3 import Qwen3, parallelize_qwen3
from hyper_parallel.dmodule.types import MeshAxisName
from hyper_parallel.dtensor import Partial, Replicate


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


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sp"])
def test_use_local_map_makes_attention_feed_forward_and_norms_regions_but_not_moe(
    sequence_parallel: bool,
) -> None:
    cfg = _tiny(use_local_map=True, sequence_parallel=sequence_parallel, num_experts=4, top_k=2)
    block = cfg.replace(mlp_only_layers=(0,)).build().layers
    attention = block[0].attention.sharding_config
    want = block_sharding(
        local_map=True,
        sequence_parallel=sequence_parallel,
        replicated_states=("rope_cos", "rope_sin", "q_norm.weight", "k_norm.weight"),
    )
    no_local_map = dataclasses.replace(want, local_map=None)
    assert dataclasses.replace(attention, local_map=None) == no_local_map
    assert attention.local_map is not None and want.local_map is not None
    assert attention.local_map.in_grad_placements == want.local_map.in_grad_placements
    # each rank's q/k norm gradient sums its own heads only: a partial sum over tp
    partial = {MeshAxisName.TP: Partial()}
    assert attention.local_map.state_grad_placements == {
        "q_norm.weight": partial,
        "k_norm.weight": partial,
    }
    dense = FeedForward.Config.tensor_parallel(local_map=True, sequence_parallel=sequence_parallel)
    assert block[0].feed_forward.sharding_config == dense.sharding_config
    assert block[1].feed_forward.sharding_config == MoE.Config().sharding_config
    norm = block[0].attention_norm.sharding_config
    if sequence_parallel:  # as llama-ref's: the sequence-parallel norms stay DTensor ops
        assert norm == RMSNorm.Config.sequence_parallel(16).sharding_config
    else:
        assert norm == RMSNorm.Config.local_map(16).sharding_config


def test_region_blocks_make_the_dense_blocks_regions_only() -> None:
    cfg = _tiny(use_local_map=True, region_blocks=True, num_experts=4, top_k=2)
    blocks = cfg.replace(mlp_only_layers=(0, 2)).build().layers
    regions = [layer.sharding_config is not None for layer in blocks]
    assert regions == [True, False, True]
    assert blocks[0].sharding_config.local_map is not None
    assert blocks[0].sharding_config.in_dst_shardings == {"x": {MeshAxisName.TP: Replicate()}}


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

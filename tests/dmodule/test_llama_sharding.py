"""llama-ref's plan in ``models/llama_sharding.py``: the layouts the layers' presets give, in order.

The oracle for the layouts is the layers' own presets (``Linear.Config.colwise``,
``Embedding.Config.vocab_parallel``, ``block_sharding``, the norm presets), composed part by
part as their docstrings describe llama-ref: every module of a built model must carry exactly
that ``ShardingConfig``, for each variant. Values and collectives under that plan are
checked against one process by ``test_llama.py`` and ``tests/integration``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hyper_parallel.dmodule import LocalMapConfig, MeshAxisName, ShardingConfig
from hyper_parallel.dmodule.layers import (
    Attention,
    Embedding,
    FeedForward,
    Linear,
    RMSNorm,
)
from hyper_parallel.dmodule.models import llama_sharding
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama
from hyper_parallel.dtensor import Replicate, Shard

TP = MeshAxisName.TP

VARIANTS = {
    "dtensor": {},
    "local_map": {"use_local_map": True},
    "sequence_parallel": {"sequence_parallel": True},
    "local_map-sp": {"use_local_map": True, "sequence_parallel": True},
    "no-vocab-parallel": {"vocab_parallel": False},
    "no-vocab-parallel-sp": {"vocab_parallel": False, "sequence_parallel": True},
    "region_blocks": {"use_local_map": True, "region_blocks": True},
    "region_blocks-sp": {"use_local_map": True, "region_blocks": True, "sequence_parallel": True},
}


def _tiny(**flags: Any) -> Llama.Config:
    return Llama.Config(
        vocab_size=32,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=32,
        max_seq_len=8,
        **flags,
    )


def _expected(cfg: Llama.Config) -> dict[str, ShardingConfig | None]:
    """Each module's sharding, from the layers' presets (projections: their own states_only)."""
    sp, lm = cfg.sequence_parallel, cfg.use_local_map
    if sp:
        norm = RMSNorm.Config.sequence_parallel(cfg.dim).sharding_config
    elif lm:
        norm = RMSNorm.Config.local_map(cfg.dim).sharding_config
    else:
        norm = RMSNorm.Config(dim=cfg.dim).sharding_config
    if cfg.vocab_parallel:
        embedding = Embedding.Config.vocab_parallel(1, 1, sequence_parallel=sp).sharding_config
        output = Linear.Config.colwise(1, 1, sequence_parallel=sp).sharding_config
    else:
        embedding = Embedding.Config.replicated(1, 1).sharding_config
        output = Linear.Config.replicated(1, 1).sharding_config
    colwise = Linear.Config.colwise(1, 1, states_only=True).sharding_config
    rowwise = Linear.Config.rowwise(1, 1, states_only=True).sharding_config
    attention = Attention.Config.tensor_parallel(local_map=lm, sequence_parallel=sp)
    feed_forward = FeedForward.Config.tensor_parallel(local_map=lm, sequence_parallel=sp)
    block: ShardingConfig | None = None
    block_norm = norm
    if cfg.region_blocks:  # the block an outer region over the residual stream
        stream = {TP: Shard(1) if sp else Replicate()}
        block = ShardingConfig(
            in_dst_shardings={"x": stream}, out_src_shardings=stream, local_map=LocalMapConfig()
        )
        block_norm = RMSNorm.Config.local_map(cfg.dim, sequence_parallel=sp).sharding_config
        for part in (attention, feed_forward) if sp else ():
            # an inner region's plain input is laid out as it declares: the norm's shards
            assert part.sharding_config is not None
            part.sharding_config = dataclasses.replace(
                part.sharding_config, in_src_shardings={"x": stream}
            )
    found: dict[str, ShardingConfig | None] = {
        "": None,
        "tok_embeddings": embedding,
        "layers": None,
        "norm": norm,
        "output": output,
    }
    for i in range(cfg.n_layers):
        name = f"layers.{i}"
        found |= {
            name: block,
            f"{name}.attention_norm": block_norm,
            f"{name}.attention": attention.sharding_config,
            f"{name}.ffn_norm": block_norm,
            f"{name}.feed_forward": feed_forward.sharding_config,
            **{f"{name}.attention.{w}": colwise for w in ("wq", "wk", "wv")},
            f"{name}.attention.wo": rowwise,
            **{f"{name}.feed_forward.{w}": colwise for w in ("w1", "w3")},
            f"{name}.feed_forward.w2": rowwise,
        }
    return found


@pytest.mark.parametrize("flags", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_module_carries_the_plan_of_its_variant(flags: dict[str, Any]) -> None:
    cfg = _tiny(**flags)
    model = cfg.build()
    got = {name: getattr(m, "sharding_config", None) for name, m in model.named_modules()}
    assert got == _expected(cfg)
    assert cfg.block() == llama_sharding.block_config(cfg)


def test_both_block_norms_and_the_final_norm_share_one_config_but_not_one_object() -> None:
    cfg = _tiny(sequence_parallel=True)
    block = cfg.block()
    assert block.attention_norm == block.ffn_norm == llama_sharding.norm_config(cfg)
    assert block.attention_norm is not block.ffn_norm  # each part owns its copy


class _FakeMesh:
    """Just the names and sizes parallelize_llama reads to choose its steps."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.mesh_dim_names = names

    def __getitem__(self, name: str) -> str:
        return f"mesh[{name}]"


@pytest.mark.parametrize(
    ("names", "tp_mesh"),
    [(("dp_shard", "tp"), "mesh[tp]"), (("dp_shard",), None), (("dp",), "whole")],
)
def test_parallelize_llama_runs_tp_then_ac_then_compile_then_fsdp(
    names: tuple[str, ...], tp_mesh: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, object]] = []
    mesh = _FakeMesh(names)
    for step in ("apply_tp", "apply_compile", "apply_fsdp"):
        monkeypatch.setattr(
            llama_sharding,
            step,
            lambda model, *args, _step=step, **_: calls.append((_step, args[0] if args else None)),
        )
    monkeypatch.setattr(
        llama_sharding,
        "apply_activation_checkpointing",
        lambda blocks, mode: calls.append(("apply_activation_checkpointing", mode)),
    )
    model = _tiny().build()
    assert parallelize_llama(model, mesh, {"activation_checkpoint": "full"}) is model  # type: ignore[arg-type]
    expected_tp = [("apply_tp", mesh if tp_mesh == "whole" else tp_mesh)] if tp_mesh else []
    assert calls == [
        *expected_tp,
        ("apply_activation_checkpointing", "full"),
        ("apply_compile", None),
        ("apply_fsdp", mesh),
    ]


class _SizedMesh:
    """Names and sizes by axis, and the sub-mesh names ``mesh[...]`` would give."""

    def __init__(self, **sizes: int) -> None:
        self.mesh_dim_names = tuple(sizes)
        self._sizes = tuple(sizes.values())

    def size(self, index: int) -> int:
        return self._sizes[index]

    def __getitem__(self, names: str | tuple[str, ...]) -> tuple[str, ...]:
        return (names,) if isinstance(names, str) else names


@pytest.mark.parametrize(
    ("sizes", "cp", "expected"),
    [
        ({"dp_shard": 2, "tp": 2}, 1, (("dp_shard",), 2)),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 1, (("dp_replicate", "dp_shard"), 4)),
        ({"dp_replicate": 1, "dp_shard": 4}, 1, (("dp_shard",), 4)),  # one replica: plain FSDP
        ({"dp_shard": 2, "cp": 2}, 2, (("dp_shard", "cp"), 2)),
        ({"dp": 2, "tp": 2}, 1, None),
        ({"tp": 4}, 1, None),
    ],
)
def test_one_data_parallel_mesh_resolver_serves_both_plans(
    sizes: dict[str, int], cp: int, expected: tuple[tuple[str, ...], int] | None
) -> None:
    """The axes fully_shard runs over and the data-parallel degree, by hand from the names."""
    from hyper_parallel.dmodule.models._sharding import data_parallel_mesh

    found = data_parallel_mesh(_SizedMesh(**sizes), cp=cp, where="apply_fsdp")  # type: ignore[arg-type]
    resolved: tuple[object, int] | None = None if found is None else (found.mesh, found.dp)
    assert resolved == expected


def test_the_resolver_refuses_hsdp_with_cp_on_a_plain_mesh_naming_the_caller() -> None:
    from hyper_parallel.dmodule.models._sharding import data_parallel_mesh

    mesh = _SizedMesh(dp_replicate=2, dp_shard=2, cp=2)
    with pytest.raises(
        ValueError, match=r"^apply_fsdp: dp_replicate x dp_shard x cp .*ParallelDims"
    ):
        data_parallel_mesh(mesh, cp=2, where="apply_fsdp")  # type: ignore[arg-type]

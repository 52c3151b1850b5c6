"""ShardingConfig, LocalMapConfig and every preset round-trip through to_dict/from_dict (#12 item 3).

Placements are written by the documented placement codec ("Shard(0)", "Replicate()",
"Partial(sum)"); dotted overrides reach into a layer's sharding from the command line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from hyper_parallel.config import ConfigError, parse_cli_overrides
from hyper_parallel.dmodule import (
    PLACEMENT_CODEC,
    BaseModel,
    LocalMapConfig,
    MeshAxisName,
    Module,
    ShardingConfig,
)
from hyper_parallel.dmodule.layers import (
    Attention,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
    TransformerBlock,
)
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.types import format_placement, parse_placement
from hyper_parallel.dtensor import Partial, Replicate, Shard

TP = MeshAxisName.TP

PRESETS: dict[str, Module.Config] = {
    "linear.colwise": Linear.Config.colwise(8, 16, bias=True),
    "linear.colwise.sp": Linear.Config.colwise(8, 16, sequence_parallel=True),
    "linear.colwise.states_only": Linear.Config.colwise(8, 16, states_only=True),
    "linear.rowwise": Linear.Config.rowwise(16, 8, bias=True),
    "linear.rowwise.sp": Linear.Config.rowwise(16, 8, sequence_parallel=True),
    "linear.replicated": Linear.Config.replicated(8, 8, bias=True),
    "embedding.vocab_parallel": Embedding.Config.vocab_parallel(32, 8, sequence_parallel=True),
    "embedding.replicated": Embedding.Config.replicated(32, 8),
    "rmsnorm": RMSNorm.Config(dim=8),
    "rmsnorm.sp": RMSNorm.Config.sequence_parallel(8),
    "rmsnorm.local_map": RMSNorm.Config.local_map(8),
    "layernorm.sp": LayerNorm.Config.sequence_parallel(8),
    "attention.local_map": Attention.Config.tensor_parallel(local_map=True, dim=16, n_heads=4),
    "feed_forward.sp": FeedForward.Config.tensor_parallel(sequence_parallel=True, dim=8),
    **{
        f"llama_block.{variant}": Llama.Config(
            dim=16,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=32,
            max_seq_len=8,
            use_local_map=local_map,
            sequence_parallel=sp,
        ).block()
        for variant, (local_map, sp) in {
            "default": (False, False),
            "local_map": (True, False),
            "sequence_parallel": (False, True),
        }.items()
    },
    "llama": Llama.Config(use_local_map=True),
}


@pytest.mark.parametrize("preset", PRESETS.values(), ids=PRESETS.keys())
def test_every_preset_round_trips_through_json(preset: Module.Config) -> None:
    text = json.dumps(preset.to_dict())  # JSON data, nothing left as an object
    rebuilt = type(preset).from_dict(json.loads(text))
    assert rebuilt == preset
    assert rebuilt.sharding_config == preset.sharding_config
    assert json.loads(json.dumps(rebuilt.to_dict())) == json.loads(text)


def test_llama_blocks_round_trip() -> None:
    block = Llama.Config(sequence_parallel=True).block()
    assert TransformerBlock.Config.from_dict(json.loads(json.dumps(block.to_dict()))) == block


def test_placement_codec_writes_the_documented_strings() -> None:
    sc = ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}, "bias": {"tp": Replicate()}},
        in_dst_shardings={"x": {TP: Shard(-1)}},
        out_src_shardings=({TP: Partial("max")}, None),
        out_dst_shardings={"logits": {TP: Shard(-1)}, "aux": None},
        local_map=LocalMapConfig(in_grad_placements=({TP: Partial()}, None)),
    )
    data = sc.to_dict()
    assert data == {
        "state_shardings": {"weight": {"tp": "Shard(0)"}, "bias": {"tp": "Replicate()"}},
        "in_src_shardings": None,
        "in_dst_shardings": {"x": {"tp": "Shard(-1)"}},
        "out_src_shardings": [{"tp": "Partial(max)"}, None],
        "out_dst_shardings": {"logits": {"tp": "Shard(-1)"}, "aux": None},
        "local_map": {
            "in_grad_placements": [{"tp": "Partial(sum)"}, None],
            "compile": False,
            "state_grad_placements": {},
        },
    }
    assert ShardingConfig.from_dict(json.loads(json.dumps(data))) == sc
    assert LocalMapConfig.from_dict({"in_grad_placements": {"x": {"tp": "P"}}}) == LocalMapConfig(
        in_grad_placements={"x": {TP: Partial()}}
    )


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("Shard(0)", Shard(0)),
        ("Shard(dim=-1)", Shard(-1)),
        ("S(1)", Shard(1)),
        ("Replicate()", Replicate()),
        ("Replicate", Replicate()),
        ("R", Replicate()),
        ("Partial()", Partial()),
        ("Partial(avg)", Partial("avg")),
        ("Partial('max')", Partial("max")),
        ("Partial(reduce_op='min')", Partial("min")),
        ("P", Partial()),
    ],
)
def test_placement_codec_reads_its_own_text_and_the_reprs(text: str, placement: object) -> None:
    assert parse_placement(text) == placement
    assert parse_placement(repr(placement)) == placement
    assert parse_placement(format_placement(placement)) == placement  # type: ignore[arg-type]
    assert PLACEMENT_CODEC.decode(PLACEMENT_CODEC.encode(placement)) == placement


@pytest.mark.parametrize("text", ["Shard()", "Shard(x)", "Replicate(0)", "Partial(mul)", "Tile(0)"])
def test_from_dict_names_the_path_of_a_bad_placement(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        Linear.Config.from_dict({"sharding_config": {"state_shardings": {"weight": {"tp": text}}}})
    assert str(info.value).startswith(
        "sharding_config.state_shardings.weight.tp: expected a placement such as 'Shard(0)', "
        f"'Replicate()' or 'Partial(sum)', found str {text!r}"
    )


class Stack(BaseModel):
    """A model whose Config holds its layers' Configs, as upstream's examples are written."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        layers: list[Linear.Config] = field(
            default_factory=lambda: [Linear.Config.colwise(8, 16), Linear.Config.rowwise(16, 8)]
        )

    def __init__(self, config: Stack.Config) -> None:
        super().__init__()
        self.layers = [c.build() for c in config.layers]


def test_dotted_overrides_set_one_layers_weight_sharding_from_the_command_line() -> None:
    argv = [
        "--layers.0.sharding_config.state_shardings.weight.tp=Replicate()",
        "--layers.1.sharding_config.out_dst_shardings.tp",
        "Shard(1)",
        "--layers.1.sharding_config.state_shardings.weight",
        '{"tp": "Shard(0)"}',
    ]
    overrides, rest = parse_cli_overrides(argv, Stack.Config)
    assert rest == []
    config = Stack.Config().apply_overrides(overrides)
    first, second = (layer.sharding_config for layer in config.layers)
    assert first is not None and second is not None
    assert first.state_shardings == {"weight": {TP: Replicate()}}
    assert first.out_dst_shardings == {TP: Shard(-1)}  # the rest of the preset is kept
    assert second.out_dst_shardings == {TP: Shard(1)}
    assert second.state_shardings == {"weight": {TP: Shard(0)}}
    assert Stack.Config().layers[0].sharding_config == Linear.Config.colwise(8, 16).sharding_config


def test_a_new_axis_key_and_the_local_map_tuple_can_be_overridden() -> None:
    config = Stack.Config().apply_overrides(
        [
            "layers.0.sharding_config.state_shardings.weight.dp=Replicate()",
            'layers.1.sharding_config.local_map={"in_grad_placements": [{"tp": "Partial(sum)"}]}',
        ]
    )
    first, second = (layer.sharding_config for layer in config.layers)
    assert first is not None and second is not None and second.local_map is not None
    assert first.state_shardings["weight"] == {TP: Shard(0), MeshAxisName.DP: Replicate()}
    assert second.local_map.in_grad_placements == ({TP: Partial()},)


def test_a_bad_override_names_its_path_and_changes_nothing() -> None:
    template = Stack.Config()
    with pytest.raises(ConfigError) as info:
        template.apply_overrides(["layers.1.sharding_config.state_shardings.weight.tp=Shard(x)"])
    assert str(info.value).startswith(
        "layers.1.sharding_config.state_shardings.weight.tp: expected a placement such as"
    )
    assert template == Stack.Config()

"""ShardingConfig, named placements and their resolution against mesh axis names (no ranks)."""

from __future__ import annotations

import dataclasses

import pytest

from hyper_parallel.dmodule import (
    LocalMapConfig,
    MeshAxisName,
    ShardingConfig,
    resolve_placements,
)
from hyper_parallel.dmodule._forward import (
    EveryOutput,
    OutputMap,
    OutputSequence,
    resolve_output_layout,
)
from hyper_parallel.dtensor import Partial, Replicate, Shard


def test_resolve_placements_fills_unnamed_axes_with_replicate() -> None:
    assert resolve_placements({"tp": Shard(0)}, ("dp", "tp")) == [Replicate(), Shard(0)]
    assert resolve_placements({MeshAxisName.DP: Shard(1)}, ("dp", "tp")) == [Shard(1), Replicate()]
    assert resolve_placements({}, ("dp", "tp")) == [Replicate(), Replicate()]


def test_resolve_placements_unknown_axis_names_it_and_the_mesh_axes() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Linear\.weight: sharding_config names mesh axis 'tpp'; mesh axes are \('dp', 'tp'\)$",
    ):
        resolve_placements({"tpp": Shard(0)}, ("dp", "tp"), where="Linear.weight")
    with pytest.raises(
        ValueError, match=r"^resolve_placements: sharding_config names mesh axis 'cp'"
    ):
        resolve_placements({MeshAxisName.CP: Shard(0)}, ("tp",))


def test_resolve_placements_rejects_non_placements_and_non_mappings() -> None:
    with pytest.raises(TypeError, match=r"mesh axis 'tp': expected a Placement .*found 0"):
        resolve_placements({"tp": 0}, ("tp",))  # type: ignore[dict-item, arg-type]
    with pytest.raises(TypeError, match=r"expected placements by mesh axis name .*found \[Shard"):
        resolve_placements([Shard(0)], ("tp",))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a mesh axis name .*found 1"):
        resolve_placements({1: Shard(0)}, ("tp",))  # type: ignore[dict-item, arg-type]


def test_mesh_axis_names_are_strings() -> None:
    assert MeshAxisName.TP == "tp"  # type: ignore[comparison-overlap]
    assert str(MeshAxisName.DP) == "dp"
    by_name: dict[str, int] = {MeshAxisName.TP: 1}
    assert by_name["tp"] == 1
    assert repr(MeshAxisName.TP) == "MeshAxisName.TP"


def test_sharding_config_is_immutable_with_safe_defaults() -> None:
    config = ShardingConfig()
    assert config.state_shardings == {} and config.local_map is None
    assert ShardingConfig().state_shardings is not config.state_shardings
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.local_map = LocalMapConfig()  # type: ignore[misc]
    assert LocalMapConfig().in_grad_placements == ()  # upstream: one entry per input; none


def test_one_named_placement_lays_out_every_output() -> None:
    layout = resolve_output_layout({MeshAxisName.TP: Partial()}, ("dp", "tp"), where="X")
    assert layout == EveryOutput((Replicate(), Partial()))
    assert resolve_output_layout({}, ("tp",), where="X") == EveryOutput((Replicate(),))


def test_output_layouts_follow_tuples_lists_and_dicts() -> None:
    axes = ("tp",)
    assert resolve_output_layout(({"tp": Shard(0)}, None), axes, where="X") == OutputSequence(
        (EveryOutput((Shard(0),)), None)
    )
    assert resolve_output_layout([{}], axes, where="X") == OutputSequence(
        (EveryOutput((Replicate(),)),)
    )
    assert resolve_output_layout({"logits": {"tp": Shard(-1)}, "aux": None}, axes, where="X") == (
        OutputMap({"logits": EveryOutput((Shard(-1),)), "aux": None})
    )


def test_output_layout_errors_name_the_position() -> None:
    with pytest.raises(ValueError, match=r"^M \(out\)\[1\]: sharding_config names mesh axis 'sp'"):
        resolve_output_layout(({}, {"sp": Shard(0)}), ("tp",), where="M (out)")
    with pytest.raises(TypeError, match=r"^M: expected placements by mesh axis name"):
        resolve_output_layout(Shard(0), ("tp",), where="M")  # type: ignore[arg-type]

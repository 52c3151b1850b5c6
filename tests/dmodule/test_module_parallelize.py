"""Module.parallelize on 2 and 4 CPU ranks: numerics vs one device, outputs, errors, cycles."""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks

from hyper_parallel.dmodule import (
    LocalMapConfig,
    MeshAxisName,
    Module,
    ShardingConfig,
    ShardingError,
    check_sharding,
    validate_sharding,
)
from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

TP = MeshAxisName.TP
DP = MeshAxisName.DP
TIMEOUT_S = 240.0


class Linear(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int = 8
        out_features: int = 8
        param_init = {"weight": torch.nn.init.normal_, "bias": torch.nn.init.uniform_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(config.out_features, config.in_features))
        self.bias = torch.nn.Parameter(torch.empty(config.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def column_parallel(dp_input: bool) -> ShardingConfig:
    """Column-parallel: weight/bias Shard(0) on tp; a plain input is this rank's batch slice."""
    x_layout = {DP: Shard(0)} if dp_input else {}
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}, "bias": {TP: Shard(0)}},
        in_src_shardings={"x": x_layout},
        in_dst_shardings={"x": x_layout},
        out_dst_shardings={**x_layout, TP: Shard(-1)},
    )


def row_parallel(dp_input: bool) -> ShardingConfig:
    """Row-parallel: weight Shard(1), bias replicated; output reduced to Replicate on tp."""
    batch = {DP: Shard(0)} if dp_input else {}
    return ShardingConfig(
        state_shardings={"weight": {TP: Shard(1)}, "bias": {}},
        in_dst_shardings={"x": {**batch, TP: Shard(-1)}},
        out_dst_shardings=batch,
    )


class MLP(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 8
        hidden: int = 16
        dp_input: bool = False

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = Linear.Config(
            in_features=config.dim,
            out_features=config.hidden,
            sharding_config=column_parallel(config.dp_input),
        ).build()
        self.w2 = Linear.Config(
            in_features=config.hidden,
            out_features=config.dim,
            sharding_config=row_parallel(config.dp_input),
        ).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.w2(F.gelu(self.w1(x)))
        return y


def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale (float32 sums differ in order)."""
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))


# -- numerics -------------------------------------------------------------------------------


def _mlp_forward_backward(shape: tuple[int, ...]) -> dict[str, float]:
    mesh = _mesh(shape)
    dp_input = len(shape) == 2
    config = MLP.Config(dp_input=dp_input)
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    model = config.build()
    model.load_state_dict(reference.state_dict())
    model.parallelize(mesh)

    torch.manual_seed(1)
    x_full = torch.randn(4, 8, requires_grad=True)
    y_ref = reference(x_full)
    (y_ref**2).sum().backward()

    if dp_input:  # each dp rank feeds its batch slice
        dp = mesh.get_local_rank("dp")
        x = x_full.detach()[dp * 2 : (dp + 1) * 2].clone().requires_grad_()
    else:
        x = x_full.detach().clone().requires_grad_()
    y = model(x)
    assert isinstance(y, DTensor)
    loss = y.full_tensor().pow(2).sum() if dp_input else y.to_local().pow(2).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    diffs = {"forward": _max_diff(y.full_tensor(), y_ref)}
    assert x.grad is not None and x_full.grad is not None
    x_grad_ref = x_full.grad[dp * 2 : (dp + 1) * 2] if dp_input else x_full.grad
    diffs["input_grad"] = _max_diff(x.grad, x_grad_ref)
    for name, p in model.named_parameters():
        ref_grad = reference.get_parameter(name).grad
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor) and ref_grad is not None
        # laid out like the parameter, except that a batch-sharded input leaves the
        # gradient Partial on dp, where the parameter is Replicate (as torch leaves it)
        want = tuple(
            Partial() if dp_input and axis == 0 and pl == Replicate() else pl
            for axis, pl in enumerate(p.placements)
        )
        assert p.grad.placements == want, (name, p.grad.placements, p.placements)
        diffs[f"{name}.grad"] = _max_diff(p.grad.full_tensor(), ref_grad)
    diffs["placements_ok"] = float(
        model.w1.weight.placements[-1] == Shard(0) and model.w2.weight.placements[-1] == Shard(1)
    )
    return diffs


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_mlp_column_then_row_parallel_matches_single_device_forward_and_backward(
    shape: tuple[int, ...],
) -> None:
    world = 1
    for n in shape:
        world *= n
    for diffs in run_on_ranks(_mlp_forward_backward, world, shape, timeout_s=TIMEOUT_S):
        assert diffs.pop("placements_ok") == 1.0
        assert max(diffs.values()) < 1e-5, diffs


# -- output structures ------------------------------------------------------------------------

Pair = namedtuple("Pair", ["full", "local"])


class MultiOut(Module):
    """Returns the same column-parallel product as a DTensor and as a plain local tensor."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        kind: str = "tuple"
        param_init = {"weight": torch.nn.init.normal_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.kind = config.kind
        self.weight = torch.nn.Parameter(torch.empty(8, 4))

    def forward(self, x: torch.Tensor) -> Any:
        y = F.linear(x, self.weight)
        local = y.to_local() if isinstance(y, DTensor) else y
        if self.kind == "tuple":
            return y, local, "extra"
        if self.kind == "list":
            return [y, local]
        if self.kind == "namedtuple":
            return Pair(y, local)
        return {"full": y, "local": local, "note": None}


_COLUMN = {TP: Shard(-1)}
_OUT_SPECS: dict[str, tuple[Any, Any]] = {
    # kind: (out_src_shardings, out_dst_shardings)
    "tuple": ((None, _COLUMN, None), {TP: Replicate()}),  # one layout for every output
    "list": ([None, _COLUMN], [{TP: Replicate()}, {TP: Replicate()}]),
    "namedtuple": ((None, _COLUMN), ({}, {})),
    "dict": ({"local": _COLUMN}, {"full": {}, "local": {}}),
}


def _multi_outputs(kind: str) -> dict[str, Any]:
    mesh = _mesh((2,))
    out_src, out_dst = _OUT_SPECS[kind]
    sharding = ShardingConfig(
        state_shardings={"weight": {TP: Shard(0)}},
        in_src_shardings={"x": {}},
        out_src_shardings=out_src,
        out_dst_shardings=out_dst,
    )
    torch.manual_seed(0)
    model = MultiOut.Config(kind=kind, sharding_config=sharding).build()
    model.init_states()
    expected_weight = model.weight.detach().clone()
    model.parallelize(mesh)
    x = torch.randn(3, 4)
    out = model(x)
    expected = x @ expected_weight.T
    items = list(out.values()) if isinstance(out, dict) else list(out)
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    return {
        "type": type(out).__name__,
        "all_dtensor_replicate": all(
            isinstance(t, DTensor) and t.placements == (Replicate(),) for t in tensors
        ),
        "count": len(tensors),
        "max_diff": max(
            _max_diff(t.to_local() if isinstance(t, DTensor) else t, expected) for t in tensors
        ),
        "non_tensors": [t for t in items if not isinstance(t, torch.Tensor)],
    }


@pytest.mark.parametrize("kind", ["tuple", "list", "namedtuple", "dict"])
def test_outputs_of_each_structure_get_their_own_src_and_dst_layouts(kind: str) -> None:
    for result in run_on_ranks(_multi_outputs, 2, kind, timeout_s=TIMEOUT_S):
        expected_type = {"tuple": "tuple", "list": "list", "namedtuple": "Pair", "dict": "dict"}
        assert result["type"] == expected_type[kind]
        assert result["count"] == 2
        assert result["all_dtensor_replicate"]
        assert result["max_diff"] < 1e-6
        assert result["non_tensors"] == {"tuple": ["extra"], "dict": [None]}.get(kind, [])


# -- states, identity, cycles -------------------------------------------------------------------


class Tied(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        param_init = {"weight": torch.nn.init.normal_, "frozen": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4))
        self.frozen = torch.nn.Parameter(torch.empty(4), requires_grad=False)
        self.inner = torch.nn.Linear(4, 4, bias=False)
        self.inner.weight = self.weight  # tied
        self.register_buffer("table", torch.arange(8.0).reshape(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.inner(x)
        return y


def _states_and_cycles() -> dict[str, Any]:
    mesh = _mesh((2,))
    sharding = ShardingConfig(
        state_shardings={
            "weight": {TP: Shard(0)},
            "frozen": {},
            "table": {TP: Shard(1)},
        },
        in_src_shardings={"x": {}},
        out_dst_shardings={TP: Replicate()},
    )
    model = Tied.Config(sharding_config=sharding).build()
    model.init_states()
    model.weight.no_weight_decay = True  # type: ignore[attr-defined]
    full_table = model.table.clone()
    model.parallelize(mesh)
    out: dict[str, Any] = {
        "weight_is_dtensor": isinstance(model.weight, DTensor),
        "weight_is_parameter": isinstance(model.weight, torch.nn.Parameter),
        "tied": model.inner.weight is model.weight,
        "custom_attribute": getattr(model.weight, "no_weight_decay", None),
        "frozen_requires_grad": model.frozen.requires_grad,
        "table_local": model.table.to_local().tolist(),
        "table_full_ok": torch.equal(model.table.full_tensor(), full_table),
        "state_dict_keys": sorted(model.state_dict()),
        "class_name": type(model).__name__,
        "is_instance": isinstance(model, Tied),
    }
    model(torch.randn(2, 4)).to_local().sum().backward()
    out["grad_is_dtensor"] = isinstance(model.weight.grad, DTensor)

    # a DTensor parameter with matching placements is kept as it is
    keep = Tied.Config(sharding_config=sharding).build()
    keep.init_states()
    already = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    keep.weight = already
    keep.inner.weight = already
    keep.parallelize(mesh)
    out["kept_identity"] = keep.weight is already

    # to_empty after parallelize keeps DTensor parameters and their Python attributes
    keep.weight.tag = "mine"  # type: ignore[attr-defined]
    keep.to_empty(device="cpu")
    out["to_empty_dtensor"] = isinstance(keep.weight, DTensor) and keep.inner.weight is keep.weight
    out["to_empty_attribute"] = getattr(keep.weight, "tag", None)

    # no reference cycle: freed as soon as the last reference goes, even after a forward
    gc.collect()
    gc.disable()
    try:
        probe = Tied.Config(sharding_config=sharding).build()
        probe.init_states()
        probe.parallelize(mesh)
        probe(torch.randn(2, 4))
        ref = weakref.ref(probe)
        del probe
        out["freed_without_gc"] = ref() is None
    finally:
        gc.enable()

    return out


def test_parallelize_keeps_parameter_attributes_ties_and_frees_without_cycles() -> None:
    for rank, result in enumerate(run_on_ranks(_states_and_cycles, 2, timeout_s=TIMEOUT_S)):
        assert result["weight_is_dtensor"] and result["weight_is_parameter"]
        assert result["tied"]
        assert result["custom_attribute"] is True
        assert result["frozen_requires_grad"] is False
        full = torch.arange(8.0).reshape(4, 2)
        assert result["table_local"] == full[:, rank : rank + 1].tolist()
        assert result["table_full_ok"]
        assert result["state_dict_keys"] == ["frozen", "inner.weight", "table", "weight"]
        assert result["class_name"] == "Tied" and result["is_instance"]
        assert result["grad_is_dtensor"]
        assert result["kept_identity"]
        assert result["to_empty_dtensor"]
        assert result["to_empty_attribute"] == "mine"
        assert result["freed_without_gc"]


# -- errors: validated before anything changes ---------------------------------------------------


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _layer(sharding: ShardingConfig) -> Linear:
    layer: Linear = Linear.Config(in_features=4, out_features=4, sharding_config=sharding).build()
    layer.init_states()
    return layer


def _errors() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (2,))
    dp_only = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    tp_mesh = mesh["tp"]
    out: dict[str, Any] = {}

    def sharded(**kw: Any) -> ShardingConfig:
        return ShardingConfig(state_shardings={"weight": {TP: Shard(0)}}, **kw)

    out["unknown_axis"] = _error(
        lambda: _layer(ShardingConfig(state_shardings={"weight": {"tpp": Shard(0)}})).parallelize(
            mesh
        )
    )
    out["unnamed_mesh"] = _error(lambda: _layer(sharded()).parallelize(unnamed))
    out["missing_state"] = _error(
        lambda: _layer(ShardingConfig(state_shardings={"wieght": {TP: Shard(0)}})).parallelize(mesh)
    )
    out["shard_dim"] = _error(
        lambda: _layer(ShardingConfig(state_shardings={"weight": {TP: Shard(2)}})).parallelize(mesh)
    )
    out["partial_state"] = _error(
        lambda: _layer(ShardingConfig(state_shardings={"bias": {TP: Partial()}})).parallelize(mesh)
    )
    out["not_a_placement"] = _error(
        lambda: _layer(ShardingConfig(state_shardings={"weight": {TP: 0}})).parallelize(mesh)  # type: ignore[dict-item]
    )
    out["unknown_argument"] = _error(
        lambda: _layer(sharded(in_dst_shardings={"inp": {}})).parallelize(mesh)
    )
    once = _layer(sharded())
    once.parallelize(mesh)
    out["twice"] = _error(lambda: once.parallelize(mesh))
    out["replaced_after_parallelize"] = _error(
        lambda: once.set_sharding_config(ShardingConfig(state_shardings={"weight": {TP: Shard(1)}}))
    )

    # a declared column-parallel layer given the row-parallel layout before parallelize
    switched = _layer(sharded())
    with torch.no_grad():
        switched.weight.copy_(torch.arange(16.0).reshape(4, 4))
    switched.set_sharding_config(ShardingConfig(state_shardings={"weight": {TP: Shard(1)}}))
    switched.parallelize(mesh)
    weight = switched.weight
    assert isinstance(weight, DTensor)
    tp_rank = mesh.get_local_rank("tp")
    columns = torch.arange(16.0).reshape(4, 4)[:, 2 * tp_rank : 2 * tp_rank + 2]
    out["switched"] = (
        [repr(p) for p in weight.placements],
        torch.equal(weight.to_local(), columns),
    )

    mismatched = _layer(sharded())
    mismatched.weight = torch.nn.Parameter(
        distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(1)])
    )
    out["dtensor_mismatch"] = _error(lambda: mismatched.parallelize(mesh))
    out["wrong_mesh"] = _error(lambda: _layer(sharded()).parallelize(tp_mesh.mesh))  # type: ignore[arg-type]

    # a tied tensor claimed with two layouts
    class Shared(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.a = _layer(sharded())
            self.b = _layer(ShardingConfig(state_shardings={"weight": {TP: Shard(1)}}))
            self.b.weight = self.a.weight

    out["shared_conflict"] = _error(lambda: Shared.Config().build().parallelize(mesh))

    # every problem of a tree at once, with paths
    class Pair2(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.first = _layer(ShardingConfig(state_shardings={"weight": {"tpp": Shard(0)}}))
            self.second = _layer(sharded(out_dst_shardings={"sp": Shard(0)}))

    pair = Pair2.Config().build()
    out["all_problems"] = validate_sharding(pair, mesh)
    out["check_raises"] = _error(lambda: check_sharding(pair, mesh))
    out["sharding_error_is_value_error"] = issubclass(ShardingError, ValueError)

    # nothing half-applied: the first child is fine, the second is not
    class Half(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.good = _layer(sharded(in_src_shardings={"x": {}}, out_dst_shardings={}))
            self.bad = _layer(ShardingConfig(state_shardings={"weight": {DP: Shard(0)}}))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.bad(self.good(x))
            return y

    half = Half.Config().build()
    weights = [half.good.weight, half.bad.weight]
    x = torch.randn(2, 4)
    before = half(x)
    out["half_error"] = _error(lambda: half.parallelize(tp_mesh))  # tp_mesh has no 'dp'
    out["half_unchanged"] = (
        half.good.weight is weights[0]
        and half.bad.weight is weights[1]
        and not isinstance(half.good.weight, DTensor)
        and type(half.good) is Linear
        and not half.good.is_parallelized
        and not half.is_parallelized
        and torch.equal(half(x), before)
    )
    half.parallelize(mesh)  # the mesh with both axes: now it works
    out["half_retry"] = isinstance(half.good.weight, DTensor) and half.good.is_parallelized
    _ = dp_only

    # a local_map block's forward sees local tensors: a child cannot ask for DTensor inputs
    class Block(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            pass

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.proj = _layer(sharded(in_dst_shardings={"x": {}}))

    block = Block.Config(
        sharding_config=ShardingConfig(
            local_map=LocalMapConfig(in_grad_placements={"y": {TP: Partial()}})
        )
    ).build()
    out["local_map_problems"] = validate_sharding(block, mesh)

    # a forward whose outputs do not match the declared structure fails clearly
    mismatch = MultiOut.Config(
        kind="list",
        sharding_config=ShardingConfig(
            state_shardings={"weight": {TP: Shard(0)}},
            in_src_shardings={"x": {}},
            out_dst_shardings=({}, {}, {}),
        ),
    ).build()
    mismatch.init_states()
    mismatch.parallelize(mesh)
    out["output_count"] = _error(lambda: mismatch(torch.randn(2, 4)))
    return out


@pytest.fixture(scope="module")
def errors() -> dict[str, Any]:
    return run_on_ranks(_errors, 2, timeout_s=TIMEOUT_S)[0]


def test_unknown_mesh_axis_names_parameter_and_mesh_axes(errors: dict[str, Any]) -> None:
    assert (
        "Linear.weight: sharding_config names mesh axis 'tpp'; mesh axes are ('dp', 'tp')"
        in errors["unknown_axis"]
    )
    assert errors["unknown_axis"].startswith(
        "ShardingError: Linear.parallelize: 1 sharding problem"
    )


def test_mesh_without_axis_names_is_rejected(errors: dict[str, Any]) -> None:
    assert "has no mesh_dim_names" in errors["unnamed_mesh"]
    assert "mesh_dim_names=(...)" in errors["unnamed_mesh"]


def test_unknown_state_path_lists_the_existing_states(errors: dict[str, Any]) -> None:
    assert (
        "Linear.wieght: sharding_config names a state that does not exist: no parameter or "
        "buffer 'wieght'; it has ['weight', 'bias']" in errors["missing_state"]
    )


def test_shard_dim_out_of_range_names_axis_dim_and_shape(errors: dict[str, Any]) -> None:
    assert (
        "Linear.weight: mesh axis 'tp': Shard(dim=2) is out of range for a tensor of shape "
        "(4, 4) (2 dims)" in errors["shard_dim"]
    )


def test_partial_state_layout_is_rejected(errors: dict[str, Any]) -> None:
    assert (
        "Linear.bias: mesh axis 'tp': states are laid out with Shard(dim) or Replicate(), "
        "found Partial(reduce_op='sum')" in errors["partial_state"]
    )


def test_non_placement_value_is_rejected_when_the_sharding_config_is_made(
    errors: dict[str, Any],
) -> None:
    assert errors["not_a_placement"] == (
        "ConfigTypeError: state_shardings.weight.tp: expected a placement such as 'Shard(0)', "
        "'Replicate()' or 'Partial(sum)', found int 0"
    )


def test_unknown_forward_argument_lists_the_arguments(errors: dict[str, Any]) -> None:
    assert (
        "Linear: in_dst_shardings names argument 'inp', which Linear.forward does not take; "
        "its arguments are ['x']" in errors["unknown_argument"]
    )


def test_a_replaced_layout_is_the_one_parallelize_applies(errors: dict[str, Any]) -> None:
    """Declared Shard(0) over tp, replaced by Shard(1): each rank holds its two columns."""
    placements, columns_match = errors["switched"]
    assert placements == ["Replicate()", "Shard(dim=1)"]
    assert columns_match


def test_replacing_a_layout_after_parallelize_is_refused(errors: dict[str, Any]) -> None:
    message = errors["replaced_after_parallelize"]
    assert message.startswith("ValueError: Linear.set_sharding_config: the module is parallelized")
    assert "before parallelize()" in message


def test_replacing_a_layout_checks_states_and_arguments_before_changing_anything() -> None:
    layer = _layer(ShardingConfig(state_shardings={"weight": {TP: Shard(0)}}))
    declared = layer.sharding_config
    wrong = ShardingConfig(state_shardings={"wieght": {TP: Shard(1)}}, in_dst_shardings={"inp": {}})
    with pytest.raises(ValueError) as raised:
        layer.set_sharding_config(wrong)
    message = str(raised.value)
    assert message.startswith("Linear.set_sharding_config: ")
    assert "no parameter or buffer 'wieght'; it has ['weight', 'bias']" in message
    assert "in_dst_shardings names argument 'inp'" in message and "['x']" in message
    assert layer.sharding_config is declared
    with pytest.raises(TypeError, match="expected a ShardingConfig or None, found"):
        layer.set_sharding_config({"weight": {TP: Shard(1)}})  # type: ignore[arg-type]
    assert layer.sharding_config is declared


def test_replacing_a_layout_returns_the_previous_one_and_none_means_no_layout() -> None:
    layer = _layer(ShardingConfig(state_shardings={"weight": {TP: Shard(0)}}))
    declared = layer.sharding_config
    rowwise = ShardingConfig(state_shardings={"weight": {TP: Shard(1)}})
    assert layer.set_sharding_config(rowwise) is declared
    assert layer.sharding_config is rowwise
    assert layer.set_sharding_config(None) is rowwise
    assert layer.sharding_config is None  # not the declared one: no layout of its own
    layer.set_sharding_config(declared)
    assert layer.sharding_config is declared


def test_parallelize_twice_is_an_error(errors: dict[str, Any]) -> None:
    assert "Linear: already parallelized" in errors["twice"]


def test_dtensor_parameter_with_other_placements_is_an_error(errors: dict[str, Any]) -> None:
    message = errors["dtensor_mismatch"]
    assert "Linear.weight: already a DTensor on" in message
    assert "with placements (Replicate(), Shard(dim=1)), but sharding_config expects " in message
    assert "[Replicate(), Shard(dim=0)]" in message


def test_not_a_mesh_is_rejected(errors: dict[str, Any]) -> None:
    assert (
        "parallelize: expected a DeviceMesh or a ParallelDims, found Tensor" in errors["wrong_mesh"]
    )


def test_tied_tensor_with_two_layouts_is_an_error(errors: dict[str, Any]) -> None:
    message = errors["shared_conflict"]
    assert "Linear.weight (at 'b'): the same tensor is also Linear.weight (at 'a')" in message
    assert "a shared state has one layout" in message


def test_validate_sharding_reports_every_problem_of_the_tree_at_once(
    errors: dict[str, Any],
) -> None:
    assert errors["all_problems"] == [
        "Linear.weight (at 'first'): sharding_config names mesh axis 'tpp'; mesh axes are "
        "('dp', 'tp')",
        "Linear at 'second' (out_dst_shardings): sharding_config names mesh axis 'sp'; "
        "mesh axes are ('dp', 'tp')",
    ]
    assert errors["check_raises"].startswith("ShardingError: Pair2.parallelize: 2 sharding problem")
    assert errors["sharding_error_is_value_error"]


def test_failed_parallelize_changes_nothing_and_can_be_retried(errors: dict[str, Any]) -> None:
    assert (
        "Linear.weight (at 'bad'): sharding_config names mesh axis 'dp'; mesh axes are ('tp',)"
        in errors["half_error"]
    )
    assert errors["half_unchanged"]
    assert errors["half_retry"]


def test_local_map_block_children_cannot_declare_io_shardings(errors: dict[str, Any]) -> None:
    assert errors["local_map_problems"] == [
        "Block: local_map.in_grad_placements names argument 'y', which Block.forward does not "
        "take; its arguments are []",
        "Linear at 'proj': declares input/output shardings but runs inside the local_map "
        "block '', whose forward sees local tensors only",
    ]


def test_output_count_mismatch_names_the_module(errors: dict[str, Any]) -> None:
    assert (
        errors["output_count"]
        == "ValueError: MultiOut: out_dst_shardings has 3 layouts, but forward returned 2 outputs "
        "at output"
    )

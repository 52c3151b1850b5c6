"""Regions inside a region: a block that is a ``local_map`` region calling its norm and MLP
regions, which then run on plain local tensors (no DTensor between them).

Oracles: one process on the full tensors (the same modules, never parallelized), trained
the same 3 AdamW steps; and the same model with the block NOT a region (today's path:
DTensors between the regions), which must issue the same collectives and give the same
numbers. Both with replicated activations (tensor parallel) and with sequence shards
(sequence parallel: all-gather in, reduce-scatter out, their transposes in backward; the
norms' replicated weights get partial gradients, declared by ``state_grad_placements``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import (
    LocalMapConfig,
    MeshAxisName,
    Module,
    ShardingConfig,
    compile_local_maps,
)
from hyper_parallel.dmodule.activation_checkpoint import apply_activation_checkpointing
from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

TP = MeshAxisName.TP
REP = {TP: Replicate()}
SEQ = {TP: Shard(1)}
DIM, HIDDEN = 16, 32


def _norm_sharding(sp: bool) -> ShardingConfig:
    # under sequence parallel the replicated weight's local gradient sums this rank's
    # tokens only: declared Partial, it is reduced once where it accumulates
    return ShardingConfig(
        state_shardings={"weight": REP},
        in_dst_shardings={"x": SEQ if sp else REP},
        out_src_shardings=SEQ if sp else REP,
        local_map=LocalMapConfig(state_grad_placements={"weight": {TP: Partial()}} if sp else {}),
    )


class Norm(Module):
    """RMSNorm on local tensors (replicated or sequence-sharded activations)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return y * self.weight


def _mlp_sharding(sp: bool) -> ShardingConfig:
    return ShardingConfig(
        state_shardings={"w1": {TP: Shard(0)}, "w2": {TP: Shard(1)}},
        in_src_shardings={"x": SEQ} if sp else None,
        in_dst_shardings={"x": REP},
        out_src_shardings={TP: Partial()},
        out_dst_shardings=SEQ if sp else REP,
        local_map=LocalMapConfig(in_grad_placements={"x": {TP: Partial()}}),
    )


class Mlp(Module):
    """Column-parallel ``w1``, row-parallel ``w2``: Megatron's f and g at its boundary."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(HIDDEN, DIM) / DIM**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(DIM, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1)), self.w2)


class Block(Module):
    """Pre-norm residual block, written as plain code between its regions."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        sp: bool = False

    def __init__(self, config: Config) -> None:
        super().__init__()
        sp = config.sp
        self.norm1 = Norm.Config(sharding_config=_norm_sharding(sp)).build()
        self.mlp1 = Mlp.Config(sharding_config=_mlp_sharding(sp)).build()
        self.norm2 = Norm.Config(sharding_config=_norm_sharding(sp)).build()
        self.mlp2 = Mlp.Config(sharding_config=_mlp_sharding(sp)).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.mlp1(self.norm1(x))
        out: torch.Tensor = h + self.mlp2(self.norm2(h))
        return out


class Stack(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        sp: bool = False
        nested: bool = False  # each block an outer region

    def __init__(self, config: Config) -> None:
        super().__init__()
        layout = SEQ if config.sp else REP
        outer = ShardingConfig(
            in_dst_shardings={"x": layout}, out_src_shardings=layout, local_map=LocalMapConfig()
        )
        self.layers = torch.nn.ModuleList(
            Block.Config(sp=config.sp, sharding_config=outer if config.nested else None).build()
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _train(
    model: torch.nn.Module,
    mesh: Any,
    sp: bool,
    steps: int = 3,
    comm: CommDebugMode | None = None,
) -> list[dict[str, Any]]:
    """3 AdamW steps; per step the loss, every gradient as a full tensor, the collectives
    (recorded by a CommDebugMode per step, or by ``comm`` over all steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x_full = torch.randn(2, 4, DIM)
        opt.zero_grad()
        x = (
            x_full
            if mesh is None
            else distribute_tensor(x_full, mesh, [Shard(1) if sp else Replicate()])
        ).requires_grad_()  # as every block's input: the compiled block compiles once
        with contextlib.nullcontext(comm) if comm else CommDebugMode() as recorder:
            start = len(recorder.records())
            loss = (model(x) ** 2).mean()
            loss.backward()
            records = recorder.records()[start:]
        grads = {}
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            g = p.grad
            grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        out.append(
            {
                "loss": value.detach(),
                "grads": grads,
                "comm": [r.kind for r in records],
                "records": records,
            }
        )
        opt.step()
    return out


def _nested_regions(world_size: int) -> dict[str, Any]:
    import torch._dynamo

    torch.set_num_threads(1)
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    result: dict[str, Any] = {}
    for sp in (False, True):
        torch.manual_seed(0)
        source = Stack.Config(sp=sp).build()
        runs: dict[str, list[dict[str, Any]]] = {}
        for kind in ("flat", "nested", "checkpointed", "compiled"):
            if kind == "compiled" and sp:
                continue  # one compiled case (compiling is slow)
            model = Stack.Config(sp=sp, nested=kind != "flat").build()
            model.load_state_dict(source.state_dict())
            model.parallelize(mesh)
            if kind == "checkpointed":  # inner regions alone, recomputed in backward
                apply_activation_checkpointing([layer.mlp1 for layer in model.layers])
            if kind == "compiled":
                for layer in model.layers:
                    compile_local_maps(layer)
            started = time.perf_counter()
            if kind == "compiled":  # one mode over all steps: a new mode's hooks recompile
                with CommDebugMode() as comm:
                    runs[kind] = _train(model, mesh, sp, comm=comm)
            else:
                runs[kind] = _train(model, mesh, sp)
            result[f"seconds_{kind}_{sp}"] = time.perf_counter() - started
        one = Stack.Config(sp=sp).build()
        one.load_state_dict(source.state_dict())
        runs["one"] = _train(one, None, sp)
        result[f"runs_{sp}"] = runs
    counters = torch._dynamo.utils.counters
    result["graph_breaks"] = dict(counters["graph_break"])
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["errors"] = _errors(mesh)
    return result


class Split(Module):
    """An inner region whose declared move (Shard(0) -> Shard(1)) no plain collective makes."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Outer(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.inner = Split.Config(
            sharding_config=ShardingConfig(
                in_src_shardings={"x": {TP: Shard(0)}},
                in_dst_shardings={"x": {TP: Shard(1)}},
                local_map=LocalMapConfig(),
            )
        ).build()
        self.ok = Split.Config(
            sharding_config=ShardingConfig(in_dst_shardings={"x": REP}, local_map=LocalMapConfig())
        ).build()
        self.weight = torch.nn.Parameter(torch.ones(4))

        self.leak: torch.Tensor | None = None  # a DTensor the forward reads from elsewhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.ok if self.leak is not None else self.inner
        out: torch.Tensor = inner(self.leak if self.leak is not None else x * self.weight)
        return out  # with a leak: a DTensor reaching the inner region


def _errors(mesh: Any) -> dict[str, str]:
    outer = Outer.Config(
        sharding_config=ShardingConfig(
            state_shardings={"weight": REP}, in_dst_shardings={"x": REP}, local_map=LocalMapConfig()
        )
    ).build()
    outer.parallelize(mesh)
    x = distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    found: dict[str, str] = {}
    with CommDebugMode() as comm:
        try:
            outer(x)
        except ValueError as exc:
            found["move"] = str(exc)
        outer.leak = x
        try:
            outer(x)
        except TypeError as exc:
            found["dtensor"] = str(exc)
    found["collectives"] = str(len(comm.records()))
    bad = ShardingConfig(
        state_shardings={"weight": REP},
        in_dst_shardings={"x": REP},
        local_map=LocalMapConfig(state_grad_placements={"bias": {TP: Partial()}}),
    )
    try:
        Norm.Config(sharding_config=bad).build().parallelize(mesh)
    except ValueError as exc:
        found["state_grad"] = str(exc)
    # a norm on sequence shards that does not say how its weight's gradient is laid out:
    # taken as replicated it would be this rank's tokens' sum only, so it is refused
    undeclared = ShardingConfig(
        state_shardings={"weight": REP}, in_dst_shardings={"x": SEQ}, local_map=LocalMapConfig()
    )
    try:
        Norm.Config(sharding_config=undeclared).build().parallelize(mesh)
    except ValueError as exc:
        found["undeclared"] = str(exc)
    return found


@pytest.fixture(scope="module")
def nested() -> list[dict[str, Any]]:
    return run_on_ranks(_nested_regions, 2, 2, timeout_s=600.0)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
def test_nested_regions_train_like_one_process_and_like_flat_regions(
    nested: list[dict[str, Any]], sp: bool
) -> None:
    for result in nested:
        runs = result[f"runs_{sp}"]
        kinds = [k for k in ("nested", "checkpointed", "compiled") if k in runs]
        for step, want in enumerate(runs["one"]):
            for kind in ("flat", *kinds):
                got = runs[kind][step]
                what = f"{kind} step {step}"
                assert_close_to_scale(got["loss"], want["loss"], rel=1e-5, what=f"{what} loss")
                assert got["grads"].keys() == want["grads"].keys()
                for name, g in want["grads"].items():
                    assert_close_to_scale(got["grads"][name], g, rel=1e-5, what=f"{what} {name}")
            flat = runs["flat"][step]
            nested_run = runs["nested"][step]
            # the same collectives as the flat regions, and the same numbers (up to the
            # order autograd sums a residual's gradients in: last bits)
            # (a state gradient's reduction may come at another point: the outer region
            # hands every state of the block its gradient through one node)
            assert sorted(nested_run["comm"]) == sorted(flat["comm"]), (
                nested_run["comm"],
                flat["comm"],
            )
            assert_close_to_scale(nested_run["loss"], flat["loss"], rel=1e-6, what="loss")
            for name, g in flat["grads"].items():
                assert_close_to_scale(nested_run["grads"][name], g, rel=1e-6, what=name)
        per_block = runs["nested"][0]["comm"]
        if not sp:  # Megatron's 2 + 2 all-reduces per block, nothing else
            assert per_block == ["all_reduce"] * 8, per_block
        else:  # per block: 2 all-gathers and 2 reduce-scatters each way; the norm weights'
            # partial sums stay Partial in the backward (as torch), reduced by the step
            assert sorted(per_block) == sorted(["all_gather"] * 8 + ["reduce_scatter"] * 8), (
                per_block
            )


def test_compiled_outer_region_has_no_graph_break(nested: list[dict[str, Any]]) -> None:
    for result in nested:
        assert not result["graph_breaks"], result["graph_breaks"]
        # one graph for both blocks and all 3 steps (the layers do not specialise it)
        assert result["graphs"] == 1, result["graphs"]
        assert "compiled" in result["runs_False"]


def test_comm_debug_mode_counts_the_compiled_region_like_the_eager_one(
    nested: list[dict[str, Any]],
) -> None:
    # the compiled block's collectives are torch's functional collectives run by its
    # graphs (no hp-dtensor collective): the same kinds, bytes, group sizes and mesh axes
    # as the eager nested run, step by step
    for result in nested:
        runs = result["runs_False"]
        for step, eager in enumerate(runs["nested"]):
            compiled = runs["compiled"][step]
            want = sorted(eager["records"], key=repr)
            assert want, "the eager run issues collectives"
            assert sorted(compiled["records"], key=repr) == want, (compiled["records"], want)
            assert {r.mesh_axis for r in compiled["records"]} == {"tp"}, compiled["records"]


def test_inner_region_refuses_what_no_plain_move_places(nested: list[dict[str, Any]]) -> None:
    for result in nested:
        errors = result["errors"]
        assert "Split" in errors["move"] and "'x'" in errors["move"], errors
        assert "Shard(dim=0)" in errors["move"] and "Shard(dim=1)" in errors["move"], errors
        assert "Split" in errors["dtensor"] and "DTensor" in errors["dtensor"], errors
        assert errors["collectives"] == "0", errors  # refused before any collective
        assert "state_grad_placements['bias']" in errors["state_grad"], errors
        assert "['weight']" in errors["state_grad"], errors
        undeclared = errors["undeclared"]
        assert "parameter 'weight' is replicated over 'tp'" in undeclared, errors
        assert "input 'x' is sharded over it" in undeclared, errors
        assert "state_grad_placements={'weight': {'tp': Partial()}}" in undeclared, errors


def test_state_grad_placements_round_trip_as_data() -> None:
    config = LocalMapConfig(state_grad_placements={"weight": {TP: Partial()}})
    data = config.to_dict()
    assert data["state_grad_placements"] == {"weight": {"tp": "Partial(sum)"}}
    assert LocalMapConfig.from_dict(data) == config
    assert LocalMapConfig().state_grad_placements == {}

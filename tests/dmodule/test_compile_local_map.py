"""``LocalMapConfig(compile=True)``: the local math of a block through torch.compile (inductor).

Oracle: the same block eager, on the same ranks and inputs: the same values and gradients
(within float tolerance: inductor fuses and reorders), the same collectives (the DTensor
boundaries stay eager), no recompilation across steps of one shape, no graph break.
"""

from __future__ import annotations

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


class SwiGlu(Module):
    """Column-parallel w1/w3, row-parallel w2, on local tensors."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int = 8
        hidden: int = 16
        param_init = {  # noqa: RUF012 - a Config field
            "w1": torch.nn.init.normal_,
            "w3": torch.nn.init.normal_,
            "w2": torch.nn.init.normal_,
        }
        sharding_config = ShardingConfig(
            state_shardings={"w1": {TP: Shard(0)}, "w3": {TP: Shard(0)}, "w2": {TP: Shard(1)}},
            in_dst_shardings={"x": {TP: Replicate()}},
            out_src_shardings={TP: Partial()},
            out_dst_shardings={TP: Replicate()},
            local_map=LocalMapConfig(in_grad_placements={"x": {TP: Partial()}}, compile=True),
        )

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(config.hidden, config.dim))
        self.w3 = torch.nn.Parameter(torch.empty(config.hidden, config.dim))
        self.w2 = torch.nn.Parameter(torch.empty(config.dim, config.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3)
        return F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5), self.w2)


def _compiled_vs_eager(world_size: int) -> dict[str, Any]:
    import torch._dynamo

    torch.set_num_threads(1)
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    source = SwiGlu.Config().build()
    source.init_states()
    blocks = {"compiled": SwiGlu.Config().build(), "eager": SwiGlu.Config().build()}
    for block in blocks.values():
        block.load_state_dict(source.state_dict())
        block.parallelize(mesh)
    out: dict[str, Any] = {"graphs": []}
    out["switched"] = compile_local_maps(blocks["eager"], enabled=False)  # the model-wide switch
    opts = {k: torch.optim.SGD(b.parameters(), lr=0.01) for k, b in blocks.items()}
    counters = torch._dynamo.utils.counters
    for step in range(3):
        torch.manual_seed(10 + step)
        x_full = torch.randn(2, 4, 8)
        records: dict[str, list[tuple[str, int]]] = {}
        grads: dict[str, dict[str, torch.Tensor]] = {}
        for kind, block in blocks.items():
            x = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
            opts[kind].zero_grad()
            with CommDebugMode() as comm:
                y = block(x)
                (y.to_local() ** 2).sum().backward()
            records[kind] = [(r.kind, r.nbytes) for r in comm.records()]
            assert isinstance(x.grad, DTensor)
            grads[kind] = {"y": y.to_local().detach(), "x": x.grad.to_local()}
            for name in ("w1", "w2", "w3"):
                grad = block.get_parameter(name).grad
                assert isinstance(grad, DTensor)
                grads[kind][name] = grad.to_local()
            opts[kind].step()
        for name, want in grads["eager"].items():
            assert_close_to_scale(grads["compiled"][name], want, rel=1e-4, what=f"{name} {step}")
        assert records["compiled"] == records["eager"], records
        out["graphs"].append(counters["stats"]["unique_graphs"])
    out["graph_breaks"] = dict(counters["graph_break"])
    # llama-ref's model-wide switch: every local_map block of the model compiled
    from hyper_parallel.dmodule.models.llama import Llama

    llama = Llama.Config(
        vocab_size=16,
        dim=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        ffn_dim=32,
        max_seq_len=8,
        use_local_map=True,
        compile_local_map=True,
    ).build()
    llama.parallelize(mesh)
    plans = [getattr(m, "_hp_forward_plan", None) for m in llama.modules()]
    local_plans = [p for p in plans if p is not None and p.local_map]
    out["llama_local_maps"] = len(local_plans)
    out["llama_compiled"] = sum(p.compile for p in local_plans)
    out["collectives"] = records["eager"]
    return out


def test_compiled_local_map_matches_eager_without_recompiles_or_graph_breaks() -> None:
    for result in run_on_ranks(_compiled_vs_eager, 2, 2, timeout_s=600.0):
        assert result["switched"] == 1
        assert result["llama_local_maps"] >= 4  # attention and feed-forward per block
        assert result["llama_compiled"] == result["llama_local_maps"]
        first, *later = result["graphs"]
        assert first >= 1, "nothing was compiled"
        assert all(n == first for n in later), f"recompiled across steps: {result['graphs']}"
        assert not result["graph_breaks"], f"graph breaks: {result['graph_breaks']}"
        kinds = [kind for kind, _ in result["collectives"]]
        assert kinds == ["all_reduce", "all_reduce"], kinds  # output fwd, input grad bwd


def test_compile_option_round_trips_and_is_off_by_default() -> None:
    config = LocalMapConfig(compile=True)
    assert LocalMapConfig.from_dict(config.to_dict()) == config
    assert LocalMapConfig().compile is False
    assert compile_local_maps(torch.nn.Linear(2, 2)) == 0  # no local_map block
    from hyper_parallel.config import ConfigError
    from hyper_parallel.dmodule.models.llama import Llama

    with pytest.raises(ConfigError, match="use_local_map"):
        Llama.Config(compile_local_map=True)

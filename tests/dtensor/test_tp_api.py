"""hp's parallelize_module, parallel styles, distribute_module and loss_parallel behave as torch's.

Oracle: torch's ``torch.distributed.tensor`` (and ``.parallel``) on the same ranks,
modules and inputs: parameter placements and shards, outputs (type, placement,
value), gradients and collective counts. Errors are checked for what they name and
for leaving the model unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale
from tests.dtensor._tp_examples import HP, TORCH, Api, collective_counts
from torch import nn

import hyper_parallel.dtensor as hp_dt
from hyper_parallel.dtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def _describe(t: Any) -> dict[str, Any]:
    """Type, layout and values of a (torch or hp) DTensor or plain tensor."""
    if hasattr(t, "placements"):
        layout = tuple(
            ("Shard", p.dim) if p.is_shard() else ("Partial" if p.is_partial() else "Replicate",)
            for p in t.placements
        )
        return {"dtensor": True, "layout": layout, "local": t.to_local().detach().clone()}
    return {"dtensor": False, "layout": None, "local": t.detach().clone()}


# -- styles: parameter layouts and outputs, against torch --------------------------------


def _style_cases(api: Api) -> list[tuple[str, type[nn.Module], Any, Any]]:
    """(name, module class, style, input) per case; the same on both sides."""
    tp, dt = api.parallel, api.dtensor
    return [
        ("colwise_linear", nn.Linear, tp.ColwiseParallel(), "x"),
        ("colwise_linear_dtensor_out", nn.Linear, tp.ColwiseParallel(use_local_output=False), "x"),
        (
            "colwise_linear_seq_in_replicated_out",
            nn.Linear,
            tp.ColwiseParallel(input_layouts=dt.Shard(1), output_layouts=dt.Replicate()),
            "x_seq",
        ),
        ("rowwise_linear", nn.Linear, tp.RowwiseParallel(), "x_features"),
        (
            "rowwise_linear_seq_out",
            nn.Linear,
            tp.RowwiseParallel(output_layouts=dt.Shard(1), use_local_output=False),
            "x_features",
        ),
        ("colwise_embedding", nn.Embedding, tp.ColwiseParallel(), "tokens"),
        (
            "rowwise_embedding",
            nn.Embedding,
            tp.RowwiseParallel(input_layouts=dt.Replicate()),
            "tokens",
        ),
        ("sequence_layernorm", nn.LayerNorm, tp.SequenceParallel(), "x_seq"),
        ("sequence_rmsnorm_local", nn.RMSNorm, tp.SequenceParallel(use_local_output=True), "x_seq"),
    ]


def _build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    if cls is nn.Linear:
        return nn.Linear(8, 12)
    if cls is nn.Embedding:
        return nn.Embedding(10, 8)
    return cls(8)


def _inputs(world_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(2, 4, 8, generator=gen)
    rank = torch.distributed.get_rank()
    return {
        "x": full,
        "x_seq": full.chunk(world_size, dim=1)[rank].contiguous(),
        "x_features": torch.randn(2, 4, 8, generator=gen).chunk(world_size, -1)[rank].contiguous(),
        "tokens": torch.randint(0, 10, (2, 4), generator=gen),
    }


def _styles_on_both_sides(world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    inputs = _inputs(world_size)
    for api in (TORCH, HP):
        mesh = api.dtensor.init_device_mesh("cpu", (world_size,))
        for name, cls, style, input_name in _style_cases(api):
            module = _build(cls)
            api.parallel.parallelize_module(module, mesh, style)
            y = module(inputs[input_name])
            loss = (y.full_tensor() if hasattr(y, "full_tensor") else y).pow(2).sum()
            loss.backward()
            out.setdefault(name, {})[api.name] = {
                "params": {n: _describe(p) for n, p in module.named_parameters()},
                "grads": {n: _describe(p.grad) for n, p in module.named_parameters()},
                "output": _describe(y),
            }
    return out


@world_sizes(2)
def test_styles_shard_parameters_and_lay_out_outputs_as_torch(world_size: int) -> None:
    results = run_on_ranks(_styles_on_both_sides, world_size, world_size)
    for rank, per_case in enumerate(results):
        for case, sides in per_case.items():
            want, got = sides["torch"], sides["hp"]
            where = f"rank {rank}, {case}"
            for kind in ("params", "output"):
                items = want[kind].items() if kind == "params" else [("output", want[kind])]
                for name, w in items:
                    g = got[kind][name] if kind == "params" else got[kind]
                    assert (g["dtensor"], g["layout"]) == (w["dtensor"], w["layout"]), (
                        f"{where}: {name}: hp {g['layout']}, torch {w['layout']}"
                    )
                    assert_close_to_scale(g["local"], w["local"], what=f"{where}: {name}")
            for name, w in want["grads"].items():
                # hp lays a gradient out like its parameter, except a Partial one that torch
                # leaves Partial too (SequenceParallel's norms)
                g = got["grads"][name]
                if w["layout"] != g["layout"]:
                    assert g["layout"] == got["params"][name]["layout"], f"{where}: grad {name}"
                else:
                    assert_close_to_scale(g["local"], w["local"], what=f"{where}: grad {name}")


# -- parallelize_module: plans, wildcards, errors ------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(self.norm(x))))  # type: ignore[no-any-return]


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _dtensor_params(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if isinstance(p, hp_dt.DTensor)]


def _plans_and_errors() -> dict[str, Any]:
    mesh = hp_dt.init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}

    model = _Stack()
    x = torch.randn(3, 8)
    want = model(x)
    parallelize_module(
        model, mesh, {"layers.*.w1": ColwiseParallel(), "layers.*.w2": RowwiseParallel()}
    )
    out["wildcard_params"] = _dtensor_params(model)
    out["wildcard_close"] = torch.allclose(model(x), want, atol=1e-6)

    def error(plan: Any, mesh_: Any = mesh) -> tuple[str, str, list[str]]:
        fresh = _Stack()
        try:
            parallelize_module(fresh, mesh_, plan)
        except Exception as e:
            return type(e).__name__, str(e), _dtensor_params(fresh)
        raise AssertionError("no error")

    # the good first entry must not be applied when a later one is bad
    out["wrong_module"] = error(
        {"layers.0.w1": ColwiseParallel(), "layers.*.norm": RowwiseParallel()}
    )
    out["two_styles"] = error({"layers.0.w1": ColwiseParallel(), "layers.*.w1": RowwiseParallel()})
    out["not_a_style"] = error({"layers.0.w1": ColwiseParallel(), "layers.0.w2": "rowwise"})
    mesh_2d = hp_dt.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out["two_d_mesh"] = error({"layers.0.w1": ColwiseParallel()}, mesh_2d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = _Stack()
        parallelize_module(fresh, mesh, {"layers.*.w9": ColwiseParallel()})
        parallelize_module(fresh, mesh, None)
    out["warnings"] = [str(w.message) for w in caught]
    out["after_warnings"] = _dtensor_params(fresh)
    twice = _Stack()
    parallelize_module(twice, mesh, {"layers.0.w1": ColwiseParallel()})
    out["twice"] = ""
    try:
        parallelize_module(twice, mesh, {"layers.0.w1": RowwiseParallel()})
    except RuntimeError as e:
        out["twice"] = str(e)
    return out


def test_parallelize_module_wildcards_and_errors_that_change_nothing() -> None:
    got = run_on_ranks(_plans_and_errors, 2)[0]
    assert got["wildcard_params"] == [
        f"layers.{i}.{w}.{p}" for i in range(3) for w in ("w1", "w2") for p in ("weight", "bias")
    ]
    assert got["wildcard_close"]
    kind, message, touched = got["wrong_module"]
    assert kind == "NotImplementedError" and "'layers.0.norm'" in message, message
    assert "LayerNorm" in message and touched == []
    kind, message, touched = got["two_styles"]
    assert kind == "ValueError" and "'layers.0.w1'" in message and touched == [], message
    kind, message, touched = got["not_a_style"]
    assert kind == "TypeError" and "'layers.0.w2'" in message and touched == [], message
    kind, message, touched = got["two_d_mesh"]
    assert kind == "ValueError" and "1-D" in message and "mesh['tp']" in message, message
    assert touched == []
    assert any("'layers.*.w9'" in w for w in got["warnings"]), got["warnings"]
    assert any("no parallelize_plan" in w for w in got["warnings"]), got["warnings"]
    assert got["after_warnings"] == []
    assert "already parallelized" in got["twice"], got["twice"]


# -- PrepareModuleInput / Output / InputOutput ---------------------------------------------


class _TwoInOut(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, *, scale: torch.Tensor) -> Any:
        return a + scale, b * 2


def _prepare_styles(api: Api, world_size: int) -> dict[str, Any]:
    dt, tp = api.dtensor, api.parallel
    mesh = dt.init_device_mesh("cpu", (world_size,))
    rank = torch.distributed.get_rank()
    a = torch.arange(8.0).reshape(2, 4).chunk(world_size, 0)[rank].contiguous()
    b = torch.ones(2, 4)
    scale = torch.full((2, 4), 3.0)
    out: dict[str, Any] = {}
    m = _TwoInOut()
    tp.parallelize_module(
        m,
        mesh,
        tp.PrepareModuleInput(
            input_layouts=(dt.Shard(0), None),
            desired_input_layouts=(dt.Replicate(), None),
            input_kwarg_layouts={"scale": dt.Replicate()},
            desired_input_kwarg_layouts={"scale": dt.Replicate()},
        ),
    )
    ya, yb = m(a, b, scale=scale)
    out["input"] = (_describe(ya), _describe(yb))
    m = _TwoInOut()
    tp.parallelize_module(
        m,
        mesh,
        tp.PrepareModuleOutput(
            output_layouts=(dt.Replicate(), None),
            desired_output_layouts=(dt.Shard(1), None),
        ),
    )
    ya, yb = m(b, b, scale=scale)
    out["output"] = (_describe(ya), _describe(yb))
    m = _TwoInOut()
    tp.parallelize_module(
        m,
        mesh,
        tp.PrepareModuleInputOutput(
            input_layouts=(dt.Shard(0), dt.Replicate()),
            desired_input_layouts=(dt.Replicate(), dt.Replicate()),
            use_local_input=False,
            output_layouts=(dt.Replicate(), dt.Replicate()),
            desired_output_layouts=(dt.Shard(0), dt.Replicate()),
            use_local_output=False,
        ),
    )
    ya, yb = m(a, b, scale=dt.distribute_tensor(scale, mesh, [dt.Replicate()]))
    out["input_output"] = (_describe(ya), _describe(yb))
    return out


def _prepare_both(world_size: int) -> dict[str, Any]:
    return {api.name: _prepare_styles(api, world_size) for api in (TORCH, HP)}


@world_sizes(2)
def test_prepare_module_input_output_styles_as_torch(world_size: int) -> None:
    for rank, sides in enumerate(run_on_ranks(_prepare_both, world_size, world_size)):
        for case, pair in sides["torch"].items():
            for i, (w, g) in enumerate(zip(pair, sides["hp"][case], strict=True)):
                where = f"rank {rank}, {case}, output {i}"
                assert (g["dtensor"], g["layout"]) == (w["dtensor"], w["layout"]), where
                assert torch.equal(g["local"], w["local"]), where


def test_prepare_styles_reject_mismatched_layout_counts() -> None:
    R, S = hp_dt.Replicate(), hp_dt.Shard(0)
    with pytest.raises(ValueError, match="desired_input_layouts"):
        PrepareModuleInput(input_layouts=(S, R), desired_input_layouts=(R,))
    with pytest.raises(ValueError, match="desired_input_layouts is required"):
        PrepareModuleInput(input_layouts=S)
    with pytest.raises(ValueError, match="desired_output_layouts"):
        PrepareModuleOutput(output_layouts=(S, R), desired_output_layouts=R)
    with pytest.raises(ValueError, match="desired_output_layouts"):
        PrepareModuleInputOutput(output_layouts=(S, R), desired_output_layouts=R)
    assert repr(SequenceParallel()) == "SequenceParallel(sequence_dim=1, use_local_output=False)"


# -- distribute_module ---------------------------------------------------------------------


def _distribute_module_side(api: Api, world_size: int) -> dict[str, Any]:
    dt = api.dtensor
    mesh = dt.init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    seen: list[str] = []

    def partition(name: str, module: nn.Module, mesh_: Any) -> None:
        seen.append(name)
        if isinstance(module, nn.Linear) and name == "0":
            for p_name, p in list(module.named_parameters()):
                sharded = dt.distribute_tensor(p, mesh_, [dt.Shard(0)])
                module.register_parameter(p_name, nn.Parameter(sharded))

    def input_fn(module: nn.Module, inputs: tuple[Any, ...], mesh_: Any) -> Any:
        return tuple(dt.DTensor.from_local(x, mesh_, [dt.Replicate()]) for x in inputs)

    def output_fn(module: nn.Module, outputs: Any, mesh_: Any) -> Any:
        return outputs.full_tensor()

    dt.distribute_module(model, mesh, partition, input_fn, output_fn)
    model.eval()
    y = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(2)))
    layouts = {
        n: _describe(t)["layout"] for n, t in [*model.named_parameters(), *model.named_buffers()]
    }
    try:
        dt.distribute_module(model, mesh)
        again = ""
    except RuntimeError as e:
        again = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dt.distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda inputs, mesh_: inputs)
    bad = nn.Linear(2, 2)
    try:
        dt.distribute_module(bad, mesh, input_fn=lambda inputs: inputs)  # type: ignore[arg-type,misc]
        arity = ""
    except ValueError:
        arity = "ValueError"
    return {
        "seen": seen,
        "layouts": layouts,
        "output": y.detach(),
        "again": again,
        "future_warning": any(issubclass(w.category, FutureWarning) for w in caught),
        "arity": arity,
        "bad_untouched": not any(hasattr(p, "placements") for p in bad.parameters()),
    }


def _distribute_module_both(world_size: int) -> dict[str, Any]:
    return {api.name: _distribute_module_side(api, world_size) for api in (TORCH, HP)}


@world_sizes(2)
def test_distribute_module_partitions_replicates_and_hooks_as_torch(world_size: int) -> None:
    for rank, sides in enumerate(run_on_ranks(_distribute_module_both, world_size, world_size)):
        want, got = sides["torch"], sides["hp"]
        assert got["seen"] == want["seen"] == ["", "0", "1", "2"]
        assert got["layouts"] == want["layouts"], f"rank {rank}"
        assert_close_to_scale(got["output"], want["output"], what=f"rank {rank}: output")
        assert "already" in got["again"] and "already" in want["again"]
        assert got["future_warning"] and want["future_warning"]
        assert got["arity"] == want["arity"] == "ValueError"
        assert got["bad_untouched"], "hp: a rejected input_fn must leave the module unchanged"


# -- loss_parallel --------------------------------------------------------------------------


def _loss_side(api: Api, world_size: int, reduction: str, weighted: bool) -> dict[str, Any]:
    dt = api.dtensor
    mesh = dt.init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 12, generator=gen)
    target = torch.randint(0, 12, (6,), generator=gen)
    weight = torch.rand(12, generator=gen) if weighted else None
    if not weighted:  # torch's loss-parallel backward fails on an ignored target with weights
        target[1] = -100
    x = dt.distribute_tensor(logits, mesh, [dt.Shard(1)]).requires_grad_()
    with api.comm_debug_mode() as fwd, api.parallel.loss_parallel():
        loss = F.cross_entropy(x, target, weight=weight, reduction=reduction)
    with api.comm_debug_mode() as bwd, api.parallel.loss_parallel():
        torch.autograd.backward(loss.sum() if reduction == "none" else loss)
    return {
        "loss": _describe(loss),
        "grad": _describe(x.grad),
        "fwd": collective_counts(fwd),
        "bwd": collective_counts(bwd),
    }


def _loss_both(world_size: int) -> dict[str, Any]:
    return {
        f"{reduction}{'_weighted' if weighted else ''}": {
            api.name: _loss_side(api, world_size, reduction, weighted) for api in (TORCH, HP)
        }
        for reduction in ("mean", "sum", "none")
        for weighted in (False, True)
    }


@world_sizes(2, 4)
def test_loss_parallel_cross_entropy_as_torch_never_gathering_logits(world_size: int) -> None:
    for rank, cases in enumerate(run_on_ranks(_loss_both, world_size, world_size)):
        for case, sides in cases.items():
            want, got = sides["torch"], sides["hp"]
            where = f"rank {rank}, {case}"
            for key in ("loss", "grad"):
                assert got[key]["layout"] == want[key]["layout"], f"{where}: {key}"
                assert_close_to_scale(got[key]["local"], want[key]["local"], what=f"{where}: {key}")
            assert got["fwd"] == want["fwd"] == {"all_reduce": 3}, f"{where}: {got['fwd']}"
            assert got["bwd"] == want["bwd"] == {}, f"{where}: {got['bwd']}"


def _loss_parallel_errors(api: Api) -> str:
    dt = api.dtensor
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(4, 6), mesh, [dt.Replicate()])
    try:
        with api.parallel.loss_parallel():
            F.cross_entropy(x, torch.zeros(4, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "no error"


def _loss_errors_both() -> dict[str, str]:
    return {api.name: _loss_parallel_errors(api) for api in (TORCH, HP)}


def test_loss_parallel_rejects_logits_not_sharded_on_classes_as_torch() -> None:
    got = run_on_ranks(_loss_errors_both, 2)[0]
    assert "exactly one mesh dim" in got["torch"], got["torch"]
    assert "exactly one mesh axis must shard the class dim" in got["hp"], got["hp"]
    assert "Replicate()" in got["hp"]


def test_loss_parallel_is_a_reentrant_context_manager() -> None:
    from hyper_parallel.dtensor._loss_parallel import loss_parallel_active

    assert not loss_parallel_active()
    with loss_parallel():
        with loss_parallel():
            assert loss_parallel_active()
        assert loss_parallel_active()
    assert not loss_parallel_active()


# -- attention on DTensors (hp only: torch has no CPU rule for the fused kernel) -------------


class _DTensorAttention(nn.Module):
    """Attention viewing the projections' DTensor outputs with the global head count."""

    def __init__(self, dim: int = 16, n_heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


def _dtensor_attention(world_size: int) -> dict[str, Any]:
    mesh = hp_dt.init_device_mesh("cpu", (world_size,))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    model = _DTensorAttention()
    parallelize_module(
        model,
        mesh,
        {"w[qkv]": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()},
    )
    hp_dt.reset_fallback_counts()
    with hp_dt.CommDebugMode() as comm:
        y = model(x)
        y.pow(2).sum().backward()
    return {
        "y": y.detach(),
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},  # type: ignore[union-attr]
        "fallbacks": hp_dt.fallback_counts(),
        "counts": comm.counts(),
    }


@world_sizes(2, 4)
def test_attention_on_dtensor_heads_needs_no_gather(world_size: int) -> None:
    ref = _DTensorAttention()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    want = ref(x)
    want.pow(2).sum().backward()
    for rank, got in enumerate(run_on_ranks(_dtensor_attention, world_size, world_size)):
        assert got["fallbacks"] == {}, f"rank {rank}: {got['fallbacks']}"
        # the rowwise output's all-reduce; the input gradient is not needed (x is a leaf
        # without grad), so nothing else moves
        assert got["counts"] == {"all_reduce": 1}, f"rank {rank}: {got['counts']}"
        assert_close_to_scale(got["y"], want.detach(), what=f"rank {rank}: output")
        for n, p in ref.named_parameters():
            assert p.grad is not None
            assert_close_to_scale(got["grads"][n], p.grad, what=f"rank {rank}: grad of {n}")


# -- linears on local shards: same results, the module's own forward respected --------------


class _DoubledLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


def _linear_paths() -> dict[str, Any]:
    import copy

    mesh = hp_dt.init_device_mesh("cpu", (2,))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    model = nn.Sequential(_DoubledLinear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    want = model(x).detach()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    got = model(x).detach()
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied[2].parameters():
            p.zero_()
    return {
        "want": want,
        "got": got,
        "subclass_forward_kept": "forward" not in vars(model[0]),
        "copy_output": copied(x).detach(),
        "original_after_copy": model(x).detach(),
    }


def test_linear_styles_keep_a_subclass_forward_and_deep_copy() -> None:
    for rank, got in enumerate(run_on_ranks(_linear_paths, 2)):
        assert got["subclass_forward_kept"], f"rank {rank}"
        assert_close_to_scale(got["got"], got["want"], what=f"rank {rank}: output")
        assert torch.equal(got["copy_output"], torch.zeros(3, 4)), f"rank {rank}: copy"
        assert torch.equal(got["original_after_copy"], got["got"]), f"rank {rank}: original"


def _loss_parallel_weighted_ignored(world_size: int, reduction: str) -> dict[str, torch.Tensor]:
    mesh = hp_dt.init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(6)
    logits, weight = torch.randn(6, 12, generator=gen), torch.rand(12, generator=gen)
    target = torch.randint(0, 12, (6,), generator=gen)
    target[2] = -100
    x = hp_dt.distribute_tensor(logits, mesh, [hp_dt.Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(x, target, weight=weight, reduction=reduction)
        torch.autograd.backward(loss.sum() if reduction == "none" else loss)
    assert isinstance(x.grad, hp_dt.DTensor) and isinstance(loss, hp_dt.DTensor)
    return {"loss": loss.full_tensor().detach(), "grad": x.grad.full_tensor()}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_parallel_with_weights_and_ignored_targets_equals_full_tensors(
    reduction: str,
) -> None:
    # torch's own loss parallel fails here (its backward gathers weights at index -100)
    gen = torch.Generator().manual_seed(6)
    logits, weight = torch.randn(6, 12, generator=gen), torch.rand(12, generator=gen)
    target = torch.randint(0, 12, (6,), generator=gen)
    target[2] = -100
    x = logits.clone().requires_grad_()
    want = F.cross_entropy(x, target, weight=weight, reduction=reduction)
    torch.autograd.backward(want.sum() if reduction == "none" else want)
    assert x.grad is not None
    for rank, got in enumerate(run_on_ranks(_loss_parallel_weighted_ignored, 2, 2, reduction)):
        assert_close_to_scale(got["loss"], want.detach(), what=f"rank {rank}: loss")
        assert_close_to_scale(got["grad"], x.grad, what=f"rank {rank}: grad")


def _entered_mesh_and_loss_guard() -> dict[str, Any]:
    mesh = hp_dt.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with mesh:
        parallelize_module(model, None, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        distributed = hp_dt.distribute_module(nn.Linear(2, 2))
    try:
        parallelize_module(nn.Linear(2, 2), None, ColwiseParallel())
        no_mesh = ""
    except RuntimeError as e:
        no_mesh = str(e)
    x = hp_dt.distribute_tensor(torch.randn(2, 6, 3), mesh, [hp_dt.Shard(1)])
    try:
        with loss_parallel():
            F.cross_entropy(x, torch.zeros(2, 3, dtype=torch.long))
        guard = ""
    except NotImplementedError as e:
        guard = str(e)
    return {
        "meshes": [getattr(p, "device_mesh", None) == mesh for p in model.parameters()],
        "distributed": [getattr(p, "device_mesh", None) == mesh for p in distributed.parameters()],
        "no_mesh": no_mesh,
        "guard": guard,
    }


def test_styles_use_the_entered_mesh_and_loss_parallel_takes_a_class_dim_not_last() -> None:
    got = run_on_ranks(_entered_mesh_and_loss_guard, 2)[0]
    assert got["meshes"] == [True] * 4 and got["distributed"] == [True] * 2
    assert "parallelize_module" in got["no_mesh"] and "with mesh" in got["no_mesh"]
    # (N, C, d) logits run under loss_parallel, as torch's (values: test_torch_fidelity_ops.py)
    assert got["guard"] == "", got["guard"]

"""TP-ready layers: numerics on 2 ranks against the same layer on full tensors in one process."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks

from hyper_parallel.dmodule.layers import (
    Attention,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
    cross_entropy,
)
from hyper_parallel.dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    init_device_mesh,
)

TOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _normalized(t: torch.Tensor) -> tuple[Placement, ...] | None:
    """Placements with non-negative shard dims (None for a plain tensor)."""
    if not isinstance(t, DTensor):
        return None
    return tuple(Shard(p.dim % t.ndim) if isinstance(p, Shard) else p for p in t.placements)


def _compare(
    config: Any,
    x: torch.Tensor,
    in_placements: list[Placement] | None,
    mesh: Any,
) -> dict[str, Any]:
    """Forward/backward of ``config``'s layer, parallelized vs not; max errors, output layout, comms."""
    torch.manual_seed(0)
    ref = config.build()
    ref.init_states()
    par = copy.deepcopy(ref).parallelize(mesh)
    float_input = x.is_floating_point()
    x_ref = x.clone().requires_grad_(float_input)
    y_ref = ref(x_ref)
    weight = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1))
    (y_ref * weight).sum().backward()  # type: ignore[no-untyped-call]
    if in_placements is None:
        x_par: torch.Tensor = x.clone().requires_grad_(float_input)
    else:
        x_par = distribute_tensor(x, mesh, in_placements, src_data_rank=None)
        x_par.requires_grad_(float_input)
    counts: Counter[str] = Counter()
    with collectives.observe_collectives(lambda record: counts.update([record.kind])):
        y_par = par(x_par)
        forward_counts = dict(counts)
        (_full(y_par) * weight).sum().backward()  # type: ignore[no-untyped-call]
    grads = [
        (_full(_grad(p)) - _grad(q)).abs().max().item()
        for p, q in zip(par.parameters(), ref.parameters(), strict=True)
    ]
    return {
        "out": (_full(y_par) - y_ref).abs().max().item(),
        "x_grad": (_full(_grad(x_par)) - _grad(x_ref)).abs().max().item() if float_input else 0.0,
        "param_grads": max(grads),
        "placements": _normalized(y_par),
        "forward_comms": forward_counts,
    }


def _loss_parallel(mesh: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen)  # 11 classes: uneven over 2 ranks
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    targets[0, :2] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref.backward()  # type: ignore[no-untyped-call]
    par_logits = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
    counts: Counter[str] = Counter()
    with collectives.observe_collectives(lambda record: counts.update([record.kind])):
        loss = cross_entropy(par_logits, targets)
        forward_counts = dict(counts)
        loss.backward()  # type: ignore[no-untyped-call]
    backward_counts = dict(counts - Counter(forward_counts))
    assert isinstance(par_logits.grad, DTensor)
    return {
        "out": abs(loss.item() - ref.item()),
        "x_grad": (par_logits.grad.full_tensor() - _grad(ref_logits)).abs().max().item(),
        "param_grads": 0.0,
        "placements": _normalized(par_logits.grad),
        "forward_comms": forward_counts,
        "backward_comms": backward_counts,
    }


CASES: dict[str, Callable[[Any], dict[str, Any]]] = {}


def _case(
    name: str,
) -> Callable[[Callable[[Any], dict[str, Any]]], Callable[[Any], dict[str, Any]]]:
    def register(fn: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
        CASES[name] = fn
        return fn

    return register


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3))


_case("linear_colwise")(
    lambda m: _compare(Linear.Config.colwise(6, 10, bias=True), _x(4, 6), None, m)
)
_case("linear_rowwise")(
    lambda m: _compare(Linear.Config.rowwise(10, 6, bias=True), _x(4, 10), [Shard(1)], m)
)
_case("embedding_vocab_parallel")(
    lambda m: _compare(
        Embedding.Config.vocab_parallel(11, 4), torch.tensor([[0, 5, 6, 10], [3, 7, 7, 1]]), None, m
    )
)
_case("embedding_vocab_parallel_sp")(
    lambda m: _compare(
        Embedding.Config.vocab_parallel(11, 4, sequence_parallel=True),
        torch.tensor([[0, 5, 6, 10], [3, 7, 7, 1]]),
        None,
        m,
    )
)
_case("rmsnorm")(lambda m: _compare(RMSNorm.Config(dim=8), _x(2, 4, 8), [Replicate()], m))
_case("rmsnorm_sp")(
    lambda m: _compare(RMSNorm.Config.sequence_parallel(8), _x(2, 4, 8), [Shard(1)], m)
)
_case("layernorm")(lambda m: _compare(LayerNorm.Config(dim=8), _x(2, 4, 8), [Replicate()], m))
_case("layernorm_sp")(
    lambda m: _compare(LayerNorm.Config.sequence_parallel(8), _x(2, 4, 8), [Shard(1)], m)
)


def _block_cases(lm: bool) -> None:
    variant = "local_map" if lm else "dtensor"

    def attention_gqa(m: Any) -> dict[str, Any]:
        cfg = Attention.Config.tensor_parallel(
            local_map=lm, dim=16, n_heads=4, n_kv_heads=2, max_seq_len=8
        )
        return _compare(cfg, _x(2, 6, 16), None, m)

    def attention_sp(m: Any) -> dict[str, Any]:
        cfg = Attention.Config.tensor_parallel(
            local_map=lm, sequence_parallel=True, dim=16, n_heads=2, max_seq_len=8
        )
        return _compare(cfg, _x(2, 6, 16), [Shard(1)], m)

    def feed_forward(m: Any) -> dict[str, Any]:
        cfg = FeedForward.Config.tensor_parallel(local_map=lm, dim=8, hidden_dim=24)
        return _compare(cfg, _x(2, 3, 8), None, m)

    _case(f"attention_gqa_{variant}")(attention_gqa)
    _case(f"attention_sp_{variant}")(attention_sp)
    _case(f"feed_forward_{variant}")(feed_forward)


_block_cases(False)
_block_cases(True)
_case("cross_entropy_loss_parallel")(_loss_parallel)


def _all_cases() -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    return {name: fn(mesh) for name, fn in CASES.items()}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    ranks = run_on_ranks(_all_cases, 2, timeout_s=180)
    assert ranks[0].keys() == ranks[1].keys()
    return ranks[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_matches_single_device_forward_and_backward(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    found = results[name]
    assert found["out"] < TOL, f"{name}: output differs by {found['out']}"
    assert found["x_grad"] < TOL, f"{name}: input gradient differs by {found['x_grad']}"
    assert found["param_grads"] < TOL, (
        f"{name}: parameter gradients differ by {found['param_grads']}"
    )


@pytest.mark.parametrize(
    ("name", "placements"),
    [
        ("linear_colwise", (Shard(1),)),  # (batch, out_features): the feature dim
        ("linear_rowwise", (Replicate(),)),
        ("embedding_vocab_parallel", (Replicate(),)),
        ("embedding_vocab_parallel_sp", (Shard(1),)),
        ("rmsnorm_sp", (Shard(1),)),
        ("attention_gqa_local_map", (Replicate(),)),
        ("attention_sp_local_map", (Shard(1),)),
        ("attention_sp_dtensor", (Shard(1),)),
        ("feed_forward_local_map", (Replicate(),)),
        ("cross_entropy_loss_parallel", (Shard(2),)),  # logits' gradient: class dim
    ],
)
def test_layer_output_has_declared_layout(
    results: dict[str, dict[str, Any]], name: str, placements: tuple[Placement, ...]
) -> None:
    assert results[name]["placements"] == placements


@pytest.mark.parametrize("name", ["attention_gqa_local_map", "feed_forward_local_map"])
def test_local_map_block_forward_is_one_all_reduce(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    assert results[name]["forward_comms"] == {"all_reduce": 1}


def test_loss_parallel_never_gathers_the_logits(results: dict[str, dict[str, Any]]) -> None:
    # forward: the softmax's row max and sum of exponentials, the loss's Partial sum;
    # backward: the softmax gradient's row sum. Each is one value per token, never the logits.
    assert results["cross_entropy_loss_parallel"]["forward_comms"] == {"all_reduce": 3}
    assert results["cross_entropy_loss_parallel"]["backward_comms"] == {"all_reduce": 1}


# -- single process: presets and errors --------------------------------------------------


def test_colwise_and_rowwise_presets_declare_megatron_layouts() -> None:
    col = Linear.Config.colwise(8, 16, bias=True).sharding_config
    row = Linear.Config.rowwise(16, 8).sharding_config
    assert col is not None and row is not None
    assert col.state_shardings == {"weight": {"tp": Shard(0)}, "bias": {"tp": Shard(0)}}
    assert col.out_dst_shardings == {"tp": Shard(-1)}
    assert row.state_shardings == {"weight": {"tp": Shard(1)}}
    assert row.in_dst_shardings == {"x": {"tp": Shard(-1)}}
    assert row.out_dst_shardings == {"tp": Replicate()}


def test_local_map_block_declares_partial_output_and_input_gradient() -> None:
    sc = FeedForward.Config.tensor_parallel(local_map=True).sharding_config
    assert sc is not None and sc.local_map is not None
    assert sc.out_src_shardings == {"tp": Partial()}
    assert sc.local_map.in_grad_placements == ({"tp": Partial()},)  # forward(x), positional


def test_layers_match_torch_reference_in_one_process() -> None:
    torch.manual_seed(0)
    norm = LayerNorm.Config(dim=8).build()
    norm.init_states()
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), F.layer_norm(x, (8,)), atol=1e-6)
    rms = RMSNorm.Config(dim=8, eps=1e-6).build()
    rms.init_states()
    assert torch.allclose(rms(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-6)


def test_attention_rejects_heads_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        Attention.Config(dim=12, n_heads=4, n_kv_heads=3).build()

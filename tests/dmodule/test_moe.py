"""MoE layers on one process: routing equal to transformers' Qwen3-MoE block, the sigmoid
router and shared experts against a per-token reference, load balancing, and bad configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests._tolerance import assert_close_to_scale

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.layers import (
    GroupedExperts,
    MoE,
    TokenChoiceTopKRouter,
    moe_aux_loss,
    update_load_balance,
)


def _built(**fields: object) -> MoE:
    torch.manual_seed(0)
    moe: MoE = MoE.Config(dim=16, hidden_dim=8, num_experts=4, **fields).build()  # type: ignore[arg-type]
    moe.init_states()
    return moe


def _per_token_reference(moe: MoE, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The MoE written token by token from its definition (no grouping, no index tricks)."""
    cfg = moe.config
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for token in x.reshape(-1, cfg.dim):
        logits = moe.router.gate.weight @ token
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        chosen = (scores + (0 if bias is None else bias)).topk(cfg.top_k).indices
        weights = scores[chosen]
        if cfg.route_norm:
            weights = weights / weights.sum()
        out = torch.zeros(cfg.dim)
        for e, w in zip(chosen.tolist(), weights * cfg.route_scale, strict=True):
            out = out + w * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token)))
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(token)
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_equals_transformers_qwen3_moe_block(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe = _built(top_k=2, route_norm=norm_topk_prob)
    hf_config = Qwen3MoeConfig(
        hidden_size=16,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(hf_config)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        block.experts.down_proj.copy_(moe.experts.w2)
    x = torch.randn(2, 5, 16)
    ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = moe(ours_in), block(theirs_in)
    assert_close_to_scale(ours, theirs, rel=1e-5)
    (ours * theirs.detach()).sum().backward()
    (theirs * theirs.detach()).sum().backward()
    assert ours_in.grad is not None and theirs_in.grad is not None
    assert_close_to_scale(ours_in.grad, theirs_in.grad, rel=1e-5)
    assert moe.router.gate.weight.grad is not None and block.gate.weight.grad is not None
    assert_close_to_scale(moe.router.gate.weight.grad, block.gate.weight.grad, rel=1e-5)
    hf_down = block.experts.down_proj.grad
    assert moe.experts.w2.grad is not None and hf_down is not None
    assert_close_to_scale(moe.experts.w2.grad, hf_down, rel=1e-5)


@pytest.mark.parametrize(
    "fields",
    [
        {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "top_k": 2},
        {"score_func": "softmax", "top_k": 3, "shared_hidden_dim": 12},
    ],
    ids=["sigmoid-norm-scale", "softmax-shared"],
)
def test_moe_equals_a_per_token_reference(fields: dict[str, object]) -> None:
    moe = _built(**fields)
    x = torch.randn(3, 4, 16)
    with torch.no_grad():
        assert_close_to_scale(moe(x), _per_token_reference(moe, x, None), rel=1e-5)


def test_expert_bias_changes_the_choice_not_the_weights() -> None:
    moe = _built(top_k=2, load_balance_coeff=1.0)
    assert moe.expert_bias is not None
    moe.expert_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))  # experts 0 and 1 always win
    x = torch.randn(6, 16)
    weights, experts, _ = moe.router(x, moe.expert_bias)
    assert sorted(set(experts.reshape(-1).tolist())) == [0, 1]
    scores = torch.softmax(moe.router.gate(x), -1)
    assert_close_to_scale(weights, scores.gather(-1, experts), rel=1e-6)
    with torch.no_grad():
        assert_close_to_scale(moe(x), _per_token_reference(moe, x, moe.expert_bias), rel=1e-5)


def test_update_load_balance_moves_the_bias_toward_the_rarely_chosen() -> None:
    moe = _built(top_k=1, load_balance_coeff=0.1)
    x = torch.randn(40, 16)
    chosen = torch.softmax(moe.router.gate(x), -1).argmax(-1)
    counts = torch.bincount(chosen, minlength=4).float()
    moe(x)
    assert moe.tokens_per_expert is not None and moe.expert_bias is not None
    assert torch.equal(moe.tokens_per_expert, counts)
    update_load_balance(moe)
    step = 0.1 * torch.sign(counts.mean() - counts)
    assert_close_to_scale(moe.expert_bias, step - step.mean(), rel=1e-6)
    assert float(moe.tokens_per_expert.abs().sum()) == 0.0
    assert "tokens_per_expert" not in moe.state_dict() and "expert_bias" in moe.state_dict()


def test_aux_loss_is_transformers_load_balancing_loss() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = _built(top_k=2, aux_loss_coeff=0.01)
    x = torch.randn(10, 16)
    moe(x)
    loss = moe_aux_loss(moe)
    assert loss is not None
    hf = load_balancing_loss_func((moe.router.gate(x),), num_experts=4, top_k=2)
    assert isinstance(hf, torch.Tensor)
    assert_close_to_scale(loss, 0.01 * hf, rel=1e-5)
    loss.backward()  # type: ignore[no-untyped-call]
    assert moe.router.gate.weight.grad is not None


def test_aux_loss_of_no_tokens_is_zero_not_nan_and_backward_runs() -> None:
    """The empty mean: a layer that routed nothing adds 0 to the summed aux loss."""
    moe = _built(top_k=2, aux_loss_coeff=0.01)
    x = torch.randn(0, 16)
    assert moe(x).shape == (0, 16)
    empty = moe_aux_loss(moe)
    assert empty is not None and empty.item() == 0.0  # torch's mean of nothing would be nan
    empty.backward()  # type: ignore[no-untyped-call]
    grad = moe.router.gate.weight.grad
    assert grad is not None and torch.equal(grad, torch.zeros_like(grad))
    # two layers, one with tokens and one without: the sum is the first one's alone
    busy = _built(top_k=2, aux_loss_coeff=0.01)
    tokens = torch.randn(10, 16)
    busy(tokens)
    alone = moe_aux_loss(busy)
    assert alone is not None
    pair = torch.nn.ModuleList([busy, moe])
    moe(x)
    total = moe_aux_loss(pair)
    assert total is not None and torch.equal(total, alone)


def test_meta_build_then_init_states_equals_a_real_build() -> None:
    cfg = MoE.Config(
        dim=16, hidden_dim=8, num_experts=4, shared_hidden_dim=8, load_balance_coeff=1.0
    )
    torch.manual_seed(3)
    real = cfg.build()
    real.init_states()
    with torch.device("meta"):
        lazy = cfg.build()
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_states()
    for (name, a), (_, b) in zip(real.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("fields", "path", "fragment"),
    [
        ({"num_experts": 4, "top_k": 5}, "top_k", "at most num_experts (4), found 5"),
        ({"score_func": "relu"}, "score_func", "'softmax', 'sigmoid', found str 'relu'"),
        ({"shared_hidden_dim": -1}, "shared_hidden_dim", "int >= 0"),
    ],
)
def test_bad_moe_config_names_the_field(
    fields: dict[str, object], path: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        MoE.Config(**fields).build()  # type: ignore[arg-type]
    assert info.value.path == path and fragment in str(info.value)
    with pytest.raises(ConfigError, match="top_k"):
        TokenChoiceTopKRouter.Config(num_experts=2, top_k=3).build()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="torch._grouped_mm needs a Hopper (sm90+) GPU",
)
def test_grouped_mm_path_equals_one_matmul_per_expert() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts.Config(dim=64, hidden_dim=32, num_experts=4).build()
    experts.init_states()
    experts = experts.to(device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([5, 0, 9, 2], device="cuda")
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = experts(x, counts)
    w1, w2, w3 = (w.float() for w in (experts.w1, experts.w2, experts.w3))
    rows = []
    for e, chunk in enumerate(torch.split(x.float(), counts.tolist())):
        rows.append((F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T)
    assert_close_to_scale(got.float(), torch.cat(rows), rel=2e-2)
    got.float().square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()

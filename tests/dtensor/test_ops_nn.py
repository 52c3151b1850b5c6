"""Neural-network ops on DTensors equal the ops on full tensors, forward and backward.

rms_norm and layer_norm; embedding with a replicated, vocab-sharded (masked lookup,
Partial output) and dim-sharded table; scaled_dot_product_attention on CPU (heads or
batch sharded, causal, grouped-query); cross_entropy / nll_loss with replicated,
batch-sharded and class-sharded logits (loss parallel); factories shaped like an
input. The CUDA attention kernels' rule is checked on specs, without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._op_oracle import OpCase, rand_shape, run_cases

from hyper_parallel.dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

_R = Replicate()
_P = Partial()


def _norm_cases(gen: torch.Generator) -> list[OpCase]:
    b, s, d = rand_shape(gen, 3, 2, 7)
    x = torch.randn(b, s, d, generator=gen)
    w = torch.randn(d, generator=gen)
    bias = torch.randn(d, generator=gen)
    batch_layouts = [(Shard(0), _R), (Shard(1), _R), (_R, _R), (Shard(2), _R), (Shard(0), Shard(0))]
    return [
        OpCase("rms_norm", lambda t, u: F.rms_norm(t, (d,), u, 1e-5), (x, w), batch_layouts),
        OpCase(
            "rms_norm_no_weight",
            lambda t: F.rms_norm(t, (d,)),
            (x,),
            [(Shard(0),), (Shard(2),), (_P,)],
        ),
        OpCase(
            "layer_norm",
            lambda t, u, v: F.layer_norm(t, (d,), u, v),
            (x, w, bias),
            [(Shard(0), _R, _R), (Shard(1), _R, _R), (Shard(2), _R, _R), (_R, Shard(0), _R)],
        ),
        OpCase(
            "layer_norm_2d_shape",
            lambda t: F.layer_norm(t, (s, d)),
            (x,),
            [(Shard(0),), (Shard(1),)],
        ),
    ]


def _embedding_cases(gen: torch.Generator) -> list[OpCase]:
    vocab, dim = 11, 6
    table = torch.randn(vocab, dim, generator=gen)
    ids = torch.randint(0, vocab, (3, 5), generator=gen)
    return [
        OpCase(
            "embedding",
            F.embedding,
            (ids, table),
            [
                (_R, _R),  # replicated table
                (_R, Shard(0)),  # vocab-sharded: masked lookup, Partial output
                (_R, Shard(1)),  # dim-sharded
                (Shard(0), _R),  # batch-sharded ids
                (Shard(1), Shard(0)),
                (Shard(0), Shard(1)),
                (_R, _P),
            ],
        ),
    ]


def _attention_cases(gen: torch.Generator) -> list[OpCase]:
    b, h, s, d = 2, 4, 5, 3
    q = torch.randn(b, h, s, d, generator=gen)
    k = torch.randn(b, h, s, d, generator=gen)
    v = torch.randn(b, h, s, d, generator=gen)
    k_gqa = torch.randn(b, 2, s, d, generator=gen)  # 2 kv heads serve 4 query heads (on 4 ranks:
    v_gqa = torch.randn(b, 2, s, d, generator=gen)  # heads do not split evenly -> batch or gather)
    heads = (Shard(1), Shard(1), Shard(1))
    batch = (Shard(0), Shard(0), Shard(0))
    mixed = (Shard(1), _R, Shard(0))
    return [
        OpCase(
            "sdpa_causal",
            lambda x, y, z: F.scaled_dot_product_attention(x, y, z, is_causal=True),
            (q, k, v),
            [heads, batch, mixed, (_R, _R, _R)],
        ),
        OpCase(
            "sdpa_scale",
            lambda x, y, z: F.scaled_dot_product_attention(x, y, z, scale=0.3),
            (q, k, v),
            [heads, batch],
        ),
        OpCase(
            "sdpa_gqa",
            lambda x, y, z: F.scaled_dot_product_attention(
                x, y, z, is_causal=True, enable_gqa=True
            ),
            (q, k_gqa, v_gqa),
            [heads, batch, (_R, _R, _R)],
        ),
    ]


def _loss_cases(gen: torch.Generator) -> list[OpCase]:
    n, c = 6, 7
    logits = torch.randn(n, c, generator=gen)
    target = torch.randint(0, c, (n,), generator=gen)
    target_ignored = target.clone()
    target_ignored[1] = -100
    weight = torch.rand(c, generator=gen) + 0.5
    layouts: list[tuple[Any, ...]] = [
        (_R, _R),  # replicated logits
        (Shard(0), Shard(0)),  # batch-sharded
        (Shard(1), _R),  # class-sharded: loss parallel
        ((Shard(0), Shard(1)), (Shard(0), _R)),  # both, on a 2-D mesh
        ((Shard(1), Shard(0)), (_R, Shard(0))),
    ]
    with_weight = [(*lay, _R if not isinstance(lay[0], tuple) else (_R, _R)) for lay in layouts]
    cases = []
    for reduction in ("mean", "sum", "none"):
        cases += [
            OpCase(
                f"cross_entropy_{reduction}",
                lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r),
                (logits, target),
                layouts,
            ),
            OpCase(
                f"cross_entropy_ignore_{reduction}",
                lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r),
                (logits, target_ignored),
                layouts,
            ),
            OpCase(
                f"cross_entropy_weight_{reduction}",
                lambda x, t, w, r=reduction: F.cross_entropy(x, t, weight=w, reduction=r),
                (logits, target_ignored, weight),
                with_weight,
                no_grad=(2,),
            ),
        ]
    cases.append(
        OpCase(
            "nll_loss_1d",
            lambda x, t: F.nll_loss(F.log_softmax(x, 0), t),
            (logits[0], target[0]),
            [(Shard(0), _R), (_R, _R)],
        )
    )
    cases.append(
        OpCase(
            "cross_entropy_label_smoothing",
            lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
            (logits, target),
            layouts[:3],
        )
    )
    return cases


def _factory_cases(gen: torch.Generator) -> list[OpCase]:
    x = torch.randn(rand_shape(gen, 2, 2, 7), generator=gen)
    every = [(Shard(0),), (Shard(1),), (_R,), (_P,)]
    not_partial = [(Shard(0),), (Shard(1),), (_R,)]
    shape = tuple(x.shape)
    return [
        OpCase("zeros_like", torch.zeros_like, (x,), every, grad=False),
        OpCase("ones_like", torch.ones_like, (x,), every, grad=False),
        OpCase("full_like", lambda t: torch.full_like(t, 2.5), (x,), every, grad=False),
        OpCase(
            # fill_ of a Partial follows torch (n * value): test_torch_semantics_partial.py
            "empty_like_filled",
            lambda t: torch.empty_like(t).fill_(1.5),
            (x,),
            not_partial,
            grad=False,
        ),
        OpCase(
            "to_empty_like",
            lambda t: torch.empty_like(t, device="cpu").zero_(),
            (x,),
            every,
            grad=False,
        ),
        OpCase("new_zeros_same", lambda t: t.new_zeros(shape), (x,), every, grad=False),
        OpCase("new_ones_same", lambda t: t.new_ones(shape), (x,), every, grad=False),
        OpCase("new_full_other", lambda t: t.new_full((3, 2), 7.0), (x,), every, grad=False),
        OpCase(
            "new_empty_filled",
            lambda t: t.new_empty(shape).fill_(3.0),
            (x,),
            not_partial,
            grad=False,
        ),
        OpCase("zeros_like_plus", lambda t: torch.zeros_like(t) + t, (x,), every),
    ]


def nn_cases() -> list[OpCase]:
    """Every nn case (built on each rank from a fixed seed)."""
    gen = torch.Generator().manual_seed(19)
    return (
        _norm_cases(gen)
        + _embedding_cases(gen)
        + _attention_cases(gen)
        + _loss_cases(gen)
        + _factory_cases(gen)
    )


@world_sizes(2, 4)
def test_nn_ops_match_full_tensors(world_size: int) -> None:
    run_cases(nn_cases, world_size)


# -- placements a user relies on ---------------------------------------------------------


def _loss_parallel_layouts(world_size: int) -> dict[str, Any]:
    """Cross-entropy on class-sharded logits: what stays sharded, and which collectives ran."""
    from hyper_parallel.dtensor import collectives

    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(3)
    logits = distribute_tensor(torch.randn(8, 10, generator=gen), mesh, [Shard(1)]).requires_grad_()
    target = distribute_tensor(torch.randint(0, 10, (8,), generator=gen), mesh, [_R])
    kinds: list[str] = []
    with collectives.observe_collectives(lambda record: kinds.append(record.kind)):
        log_probs = F.log_softmax(logits, -1)
        loss = F.nll_loss(log_probs, target)
        forward_kinds = list(kinds)
        torch.autograd.backward(loss)
    assert isinstance(log_probs, DTensor) and isinstance(loss, DTensor)
    assert isinstance(logits.grad, DTensor)
    return {
        "log_probs": log_probs.placements,
        "loss": loss.placements,
        "grad": logits.grad.placements,
        "forward_kinds": forward_kinds,
        "all_kinds": kinds,
    }


@world_sizes(2)
def test_loss_parallel_never_gathers_the_logits(world_size: int) -> None:
    got = run_on_ranks(_loss_parallel_layouts, world_size, world_size)[0]
    assert got["log_probs"] == (Shard(1),)
    assert got["loss"] == (Partial(),)
    assert got["grad"] == (Shard(1),)
    assert "all_gather" not in got["all_kinds"], got["all_kinds"]
    # the row max and the sum of exponentials, plus the mean's weight total at most
    assert set(got["forward_kinds"]) <= {"all_reduce"}


def _cuda_attention_decisions(world_size: int) -> dict[str, Any]:
    """The CUDA attention kernels' rule on specs (no GPU needed: meta shapes only)."""
    from hyper_parallel.dtensor._registry import OpCall, rule_for
    from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta

    aten = torch.ops.aten
    mesh = init_device_mesh("cpu", (world_size,))
    b, h, s, d = 2, 4, 8, 16

    def spec(shape: tuple[int, ...], p: Placement) -> DTensorSpec:
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return DTensorSpec(mesh, (p,), TensorMeta(shape, stride, torch.float16))

    def meta(shape: tuple[int, ...]) -> TensorMeta:
        return spec(shape, _R).tensor_meta

    q, k, v = (spec((b, h, s, d), Shard(1)) for _ in range(3))
    out: dict[str, Any] = {}
    flash = aten._scaled_dot_product_flash_attention.default
    call = OpCall(
        flash,
        (q, k, v, 0.0, True),
        {},
        [q, k, v],
        mesh,
        [
            meta((b, h, s, d)),
            meta((b, h, s)),
            None,
            None,
            None,
            None,
            meta((2,)),
            meta(()),
            meta((0,)),
        ],
    )
    decision = rule_for(flash)(call)  # type: ignore[misc]
    assert decision is not None
    out["flash"] = (decision.inputs, decision.outputs)
    eff = aten._scaled_dot_product_efficient_attention_backward.default
    grad_out = spec((b, h, s, d), Shard(0))
    qb, kb, vb, o = (spec((b, h, s, d), Shard(0)) for _ in range(4))
    lse = spec((b, h, 32), Shard(0))
    seed, offset = spec((2,), _R), spec((), _R)
    call = OpCall(
        eff,
        (grad_out, qb, kb, vb, None, o, lse, seed, offset, 0.0, [True, True, True, False]),
        {},
        [grad_out, qb, kb, vb, o, lse, seed, offset],
        mesh,
        [meta((b, h, s, d)), meta((b, h, s, d)), meta((b, h, s, d)), None],
    )
    decision = rule_for(eff)(call)  # type: ignore[misc]
    assert decision is not None
    out["efficient_backward"] = (decision.inputs, decision.outputs)
    return out


@world_sizes(2)
def test_cuda_attention_rules_shard_heads_and_batch_without_a_gpu(world_size: int) -> None:
    got = run_on_ranks(_cuda_attention_decisions, world_size, world_size)[0]
    ins, outs = got["flash"]
    assert ins == [(Shard(1),)] * 3  # heads stay sharded: no communication
    assert outs[0] == (Shard(1),) and outs[1] == (Shard(1),)  # output and logsumexp
    assert outs[6] == (_R,) and outs[7] == (_R,)  # RNG seed/offset
    ins, outs = got["efficient_backward"]
    assert ins == [(Shard(0),)] * 6 + [(_R,)] * 2  # batch-sharded backward stays batch-sharded
    assert outs[:3] == [(Shard(0),)] * 3 and outs[3] is None

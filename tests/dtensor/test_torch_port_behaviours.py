"""Cases of torch's DTensor tests on strides, Partial propagation, gather, histc, dist and loss parallel.

Ported in our words from ``test_dtensor.py`` (``test_dtensor_stride``),
``test_redistribute.py`` (``test_partial_to_partial_forward_backward``,
``test_replicate_to_partial``), ``test_pointwise_ops.py`` (``test_mul_partial``),
``test_tensor_ops.py`` (``test_stack``, ``test_new_empty_strided``, ``test_gather``,
``test_index_put_partial_numerics``, ``test_unbind``), ``test_math_ops.py``
(``test_histc``, ``test_dist``) and ``test_tp_examples.py``
(``test_loss_parallel_3d_input_non_batch_shard``). Each scenario runs on hp-dtensor and
on torch.distributed.tensor with the same inputs in one launch of 4 ranks and returns
plain values: global values (checked against the same computation on full tensors in
one process), placements, strides, local shapes and collective counts (each side's
``CommDebugMode``), which must equal torch's on every rank except where the README
lists a deliberate difference (``DIFFERENT``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import (
    Side,
    assert_scenarios_like_torch,
    close,
    full,
    layout,
    sides,
)

_G = torch.Generator().manual_seed(67)
_X = torch.randn(12, 8, 16, generator=_G)
_A = torch.randn(12, 8, generator=_G)
_B = torch.randn(12, 8, generator=_G)
_FIRST, _SECOND = torch.randn(4, 8, generator=_G), torch.randn(4, 8, generator=_G)
_LOGITS = torch.rand(4, 16, 6, generator=_G)
_LABELS = torch.randint(16, (4, 6), generator=_G)


def _strides(side: Side) -> dict[str, Any]:
    """``test_dtensor_stride``: a DTensor's strides describe the global tensor, as torch's."""
    S = side.Shard
    permuted = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1)).permute(1, 2, 0)
    transposed = side.distribute(_A.t(), [S(0)])
    return {
        "from_local S0": {"stride": side.from_local(torch.randn(4, 8), [S(0)]).stride()},
        "from_local S1": {"stride": side.from_local(torch.randn(8, 4), [S(1)]).stride()},
        "from_local of a permuted shard": {"stride": side.from_local(permuted, [S(1)]).stride()},
        "distribute_tensor of a transposed tensor": {
            "stride": transposed.stride(),
            "contiguous": transposed.is_contiguous(),
            "value": full(transposed),
            "want": _A.t(),
        },
        "pointwise op keeps the transposed strides": {"stride": (transposed + 1).stride()},
    }


def _partials(side: Side) -> dict[str, Any]:
    """Partial through redistribute, mul and index_put (``test_redistribute``,
    ``test_mul_partial``, ``test_index_put_partial_numerics``)."""
    P, R = side.Partial, side.Replicate
    n = side.mesh.size()
    out: dict[str, Any] = {}
    # P -> P: no collective either way; the leaf's gradient stays Partial
    leaf = side.distribute(torch.ones(12, 3, requires_grad=True), [P()])
    with side.comm() as forward:
        moved = leaf.redistribute(side.mesh, [P()])
    with side.comm() as backward:
        moved.backward(side.from_local(torch.ones(12, 3), [P()]))
    assert leaf.grad is not None
    out["P -> P"] = {
        "layout": layout(moved),
        "forward": forward,
        "backward": backward,
        "grad_layout": layout(leaf.grad),
        "value": full(leaf.grad),
        "want": torch.full((12, 3), float(n)),
    }
    ones = torch.ones(8, 8)
    for op in ("sum", "avg"):
        for name, other in (
            ("a scalar", 2.0),
            ("a 0-dim tensor", torch.tensor(2.0)),
            ("a Replicate", side.distribute(torch.full((8, 8), 2.0), [R()])),
        ):
            part = side.from_local(ones, [P(op)])
            with side.comm() as forward:
                z = part * other
            out[f"P({op}) * {name}"] = {
                "layout": layout(z),
                "forward": forward,
                "value": full(z),
                "want": ones * 2 * (n if op == "sum" else 1),
            }
    part_max = side.from_local(ones * (side.mesh.get_local_rank() + 1), [P("max")])
    replicated = side.distribute(torch.ones(8, 8), [R()])
    with side.comm() as forward:
        z = part_max * replicated
    out["P(max) * a Replicate"] = {
        "layout": layout(z),
        "forward": forward,
        "value": full(z),
        "want": ones * n,
    }
    for accumulate in (True, False):
        x = side.from_local(_A[:4] / n, [P()])
        values = side.from_local(_B[0] / n, [P()])
        with side.comm() as forward:
            put = torch.index_put(x, [torch.tensor(1)], values, accumulate)
        out[f"index_put(accumulate={accumulate}) of Partials"] = {
            "layout": layout(put),
            "forward": forward,
            "value": full(put),
            "want": torch.index_put(_A[:4], [torch.tensor(1)], _B[0], accumulate),
        }
    return out


def _tensor_ops(side: Side) -> dict[str, Any]:
    """``test_new_empty_strided``, ``test_gather``, ``test_histc``, ``test_dist``."""
    S, R = side.Shard, side.Replicate
    out: dict[str, Any] = {}
    for shape in ((12, 8), (12, 7)):
        dt = side.distribute(torch.randn(shape), [S(1)])
        with side.comm() as forward:
            empty = dt.new_empty_strided(shape, (shape[1], 1))
        out[f"new_empty_strided {shape} of S1"] = {
            "layout": layout(empty),
            "forward": forward,
            "local": tuple(empty.to_local().shape),
            "local stride": empty.to_local().stride(),
        }
    index = torch.randint(8, (4, 1, 8), generator=torch.Generator().manual_seed(2))
    source, where = side.distribute(_X, [S(1)]), side.distribute(index, [R()])
    with side.comm() as forward:
        got = torch.gather(source, 1, where)
    out["gather along its shard, index size 1 there"] = {
        "layout": layout(got),
        "forward": forward,
        "value": full(got),
        "want": torch.gather(_X, 1, index),
    }
    index = torch.randint(8, (4, 4, 8), generator=torch.Generator().manual_seed(3))
    for dim in range(3):
        source, where = side.distribute(_X, [R()]), side.distribute(index, [S(dim)])
        with side.comm() as forward:
            got = torch.gather(source, dim, where)
        out[f"gather(dim={dim}) of an index sharded on {dim}"] = {
            "layout": layout(got),
            "forward": forward,
            "value": full(got),
            "want": torch.gather(_X, dim, index),
        }
    low, high = _X.min().item(), _X.max().item()
    for ranged in (True, False):
        for placement in (S(0), S(1), S(2), R()):
            dt = side.distribute(_X, [placement])
            with side.comm() as forward:
                hist = dt.histc(min=low, max=high) if ranged else dt.histc()
            out[f"histc(ranged={ranged}) of {layout(dt)}"] = {
                "layout": layout(hist),
                "forward": forward,
                "value": full(hist),
                "want": _X.histc(min=low, max=high) if ranged else _X.histc(),
            }
    for p in (1.0, 2.0, float("inf")):
        for placement in (S(0), R()):
            a, b = side.distribute(_A, [placement]), side.distribute(_B, [placement])
            with side.comm() as forward:
                distance = torch.dist(a, b, p)
            out[f"dist(p={p}) of {layout(a)}"] = {
                "layout": layout(distance),
                "forward": forward,
                "value": full(distance),
                "want": torch.dist(_A, _B, p),
            }
    return out


def _two_dim(side: Side) -> dict[str, Any]:
    """``test_stack`` of Partials and ``test_loss_parallel_3d_input_non_batch_shard`` on (cp, tp)."""
    S, R, P = side.Shard, side.Replicate, side.Partial
    out: dict[str, Any] = {}
    coordinate = side.mesh.get_coordinate()
    # the local parts of two Partial values: on (P, R) the value's dp part, replicated on tp
    part_r = side.from_local(_FIRST * (coordinate[0] + 1), [P(), R()])
    part_p = side.from_local(_SECOND * (coordinate[0] + 1) * (coordinate[1] + 1), [P(), P()])
    with side.comm() as forward:
        stacked = torch.stack([part_r, part_p])
    out["stack of (P, R) and (P, P)"] = {
        "layout": layout(stacked),
        "forward": forward,
        "value": full(stacked),
        "want": torch.stack([_FIRST * 3, _SECOND * 9]),
    }
    loss_parallel: Callable[[], Any]
    if side.name == "hp":
        from hyper_parallel.dtensor.parallel import loss_parallel
    else:
        from torch.distributed.tensor.parallel import loss_parallel
    x, target = _LOGITS, _LABELS
    for reduction in ("sum", "none"):
        whole = x.clone().requires_grad_()
        want = F.cross_entropy(whole, target, reduction=reduction)
        torch.autograd.backward(want.sum())
        logits = side.distribute(x.clone(), [S(2), S(1)]).requires_grad_()
        labels = side.distribute(target, [S(1), R()])
        with loss_parallel():
            with side.comm() as forward:
                loss = F.cross_entropy(logits, labels, reduction=reduction)
            with side.comm() as backward:
                torch.autograd.backward(loss.sum())
        assert logits.grad is not None and whole.grad is not None
        out[f"loss parallel 3-d logits sharded on seq, {reduction}"] = {
            "layout": layout(loss),
            "forward": forward,
            "backward": backward,
            "grad_layout": layout(logits.grad),
            "value": full(loss).detach(),
            "want": want.detach(),
            "grad": full(logits.grad),
            "grad want": whole.grad,
        }
    return out


def _errors(side: Side) -> dict[str, Any]:
    """Where torch raises a ``RuntimeError`` ours does too (the text differs: README)."""
    S, R, P = side.Shard, side.Replicate, side.Partial
    attempts: dict[str, Callable[[], Any]] = {
        "Replicate -> Partial": lambda: side.distribute(_A, [R()]).redistribute(side.mesh, [P()]),
        "unbind along the sharded dim": lambda: side.distribute(_A, [S(0)]).unbind(0),
    }
    out: dict[str, Any] = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except Exception as exc:  # the class is what is compared
            out[name] = {"runtime_error": isinstance(exc, RuntimeError), "message": str(exc)}
        else:
            out[name] = {"runtime_error": False, "message": "did not raise"}
    return out


# README, "Differences from torch": what hp-dtensor gives there
DIFFERENT: dict[tuple[str, str], Any] = {
    # a Partial input of an op that needs its value: reduce-scattered (fewer bytes)
    ("P(max) * a Replicate", "layout"): (("S", 0),),
    ("P(max) * a Replicate", "forward"): {"reduce_scatter": 1},
    # a 2-norm of shards comes out Replicate (one all-reduce), not a lazy norm-Partial
    ("dist(p=2.0) of (('S', 0),)", "layout"): (("R",),),
    ("dist(p=2.0) of (('S', 0),)", "forward"): {"all_reduce": 1},
}

# what each side's message says (the class is the same: RuntimeError)
_MESSAGES = {
    "Replicate -> Partial": ("cannot redistribute Replicate() to Partial", "Can not redistribute"),
    "unbind along the sharded dim": (
        "unbind along the sharded dimension 0",
        "Sharding propagation",
    ),
}


def _both() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for side in sides((4,)):
        out[side.name] = {
            "strides": _strides(side),
            "partials": _partials(side),
            "tensor ops": _tensor_ops(side),
            "errors": _errors(side),
        }
    for side in sides((2, 2), ("cp", "tp")):
        out[side.name]["2-d"] = _two_dim(side)
    return out


def test_torch_behaviour_cases_like_torch() -> None:
    for got in run_on_ranks(_both, 4, timeout_s=300.0):
        ours, theirs = got["hp"], got["torch"]
        for name, (mine, torch_words) in _MESSAGES.items():
            assert ours["errors"][name]["runtime_error"], (name, ours["errors"][name])
            assert theirs["errors"][name]["runtime_error"], (name, theirs["errors"][name])
            assert mine in ours["errors"][name]["message"], ours["errors"][name]
            assert torch_words in theirs["errors"][name]["message"], theirs["errors"][name]
        del ours["errors"], theirs["errors"]
        for side in (ours, theirs):
            for case in side["2-d"].values():
                if "grad want" in case:
                    assert close(case["grad"], case.pop("grad want")), case
        assert_scenarios_like_torch(ours, theirs, DIFFERENT)

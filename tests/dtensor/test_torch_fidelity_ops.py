"""Partial propagation, errors, loss parallel on (N, C, d...) logits and ranks outside the mesh, as torch.

Ported from torch's ``test_pointwise_ops.py`` / ``test_redistribute.py`` /
``test_tensor_ops.py`` / ``test_embedding_ops.py`` / ``test_dtensor.py`` and TP's
``test_tp_examples.py`` (loss parallel) at the behaviours a user sees. Each case runs
on hp-dtensor and on torch.distributed.tensor with the same inputs, in one launch per
world size: output placements and forward collectives must equal torch's (each side's
``CommDebugMode``), values the same computation on full tensors in one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor._torch_twin import (
    Case,
    Side,
    assert_like_torch,
    close,
    full,
    layout,
    run_case,
    sides,
)

_G = torch.Generator().manual_seed(19)
_X = torch.randn(4, 6, generator=_G)
_Y = torch.randn(4, 6, generator=_G)
_ROW = torch.randn(6, generator=_G)
_INDEX = torch.tensor([0, 2, 2])
_VALUES = torch.randn(3, 6, generator=_G)


def _same_partial(dt: Any) -> Any:
    """``dt`` redistributed to its own Partial placements (the identity on a plain tensor)."""
    if not hasattr(dt, "placements"):
        return dt
    return dt.redistribute(dt.device_mesh, dt.placements)


CASES = [
    Case("partial + replicate", lambda p, r: p + r, (_X, _Y), ("P", "R"), backward=True),
    Case("replicate - partial", lambda r, p: r - p, (_Y, _X), ("R", "P")),
    Case("partial + broadcast replicate", lambda p, r: p + r, (_X, _ROW), ("P", "R")),
    Case("avg partial + replicate", lambda p, r: p + r, (_X, _Y), ("Pavg", "R")),
    Case("partial * partial", lambda p, q: p * q, (_X, _Y), ("P", "P"), backward=True),
    Case("stack of partials", lambda p, q: torch.stack([p, q]), (_X, _Y), ("P", "P")),
    Case("constant_pad_nd(value=0) of a partial", lambda p: F.pad(p, (1, 2)), (_X,), ("P",)),
    Case(
        "index_put(accumulate=True) into a partial",
        lambda p, i, v: torch.index_put(p, (i,), v, accumulate=True),
        (_X, _INDEX, _VALUES),
        ("P", "R", "R"),
    ),
    Case("partial -> partial is a no-op", _same_partial, (_X,), ("P",)),
    # fewer collectives in torch (item 6 of the port)
    Case("dist(p=1) of row shards", lambda a, b: torch.dist(a, b, p=1), (_X, _Y), ("S0", "S0")),
    Case(
        "gather with input and index sharded",
        lambda x, i: torch.gather(x, 1, i),
        (_X, torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0]])),
        ("S0", "S0"),
    ),
]


def _raised(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the kind and words are the result
        kinds = (NotImplementedError, RuntimeError, ValueError, TypeError)
        kind = next((k.__name__ for k in kinds if isinstance(exc, k)), type(exc).__name__)
        return f"{kind}: {exc}"
    return "ran"


def _errors(side: Side) -> dict[str, str]:
    """Where torch raises (item 7 of the port), the type and words of each side's error."""
    S, R = side.Shard, side.Replicate
    n = side.mesh.size()
    weight = side.distribute(torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), [S(1)])
    ids = side.distribute(torch.tensor([[0, 3], [5, 7]]), [R()])
    return {
        "from_local shape without stride": _raised(
            lambda: side.from_local(torch.ones(2, 3), [S(0)], shape=(2 * n, 3))
        ),
        "unbind along the sharded dim": _raised(
            lambda: torch.unbind(side.distribute(_X.clone(), [S(0)]), 0)
        ),
        "embedding max_norm on a sharded weight": _raised(
            lambda: F.embedding(ids, weight, max_norm=1.0)
        ),
        "dropout of a partial": _raised(
            lambda: F.dropout(side.from_local(_X.clone(), [side.Partial()]), 0.5, training=True)
        ),
    }


def _partial_prod(side: Side) -> dict[str, Any]:
    """torch's spelling ``Partial("prod")``: the global value is the product over ranks."""
    rank = side.mesh.get_local_rank()
    p = side.from_local(_X + rank, [side.Partial("prod")])
    with side.comm() as comm:
        try:
            value = p.full_tensor()
        except RuntimeError as exc:  # torch 2.14 accepts the name, its all-reduce does not
            return {"raised": str(exc).splitlines()[0]}
    want = torch.ones_like(_X)
    for r in range(side.mesh.size()):
        want = want * (_X + r)
    return {"close": close(value, want), "comm": comm}


def _loss_parallel_nd(side: Side) -> dict[str, Any]:
    """torch's loss parallel on ``(N, C, d)`` and ``(N, C, h, w)`` logits sharded on C."""
    if side.name == "hp":
        from hyper_parallel.dtensor.parallel import loss_parallel
    else:
        from torch.distributed.tensor.parallel import loss_parallel
    gen = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {}
    for shape, reduction in (((2, 8, 3), "mean"), ((2, 8, 2, 3), "sum"), ((3, 8, 5), "none")):
        logits = torch.randn(shape, generator=gen)
        target = torch.randint(0, 8, (shape[0], *shape[2:]), generator=gen)
        target[0, 0] = -100  # ignore_index
        x = side.distribute(logits.clone(), [side.Shard(1)]).requires_grad_()
        t = side.distribute(target, [side.Replicate()])
        with loss_parallel():
            with side.comm() as forward:
                loss = F.cross_entropy(x, t, reduction=reduction)
            with side.comm() as backward:
                torch.autograd.backward(loss.sum() if reduction == "none" else loss)
        leaf = logits.clone().requires_grad_()
        want = F.cross_entropy(leaf, target, reduction=reduction)
        torch.autograd.backward(want.sum() if reduction == "none" else want)
        assert x.grad is not None and leaf.grad is not None
        out[f"{shape} {reduction}"] = {
            "layout": layout(loss),
            "forward": forward,
            "backward": backward,
            "close": close(full(loss).detach(), want.detach()),
            "grad_close": close(full(x.grad), leaf.grad),
        }
    return out


def _outside_the_mesh(side: Side) -> dict[str, Any]:
    """A rank outside a sub-mesh holds empty locals, as torch (a reduction: a 0-dim zero)."""
    sub: Any
    if side.name == "hp":
        import hyper_parallel.dtensor as hp

        sub = hp.DeviceMesh("cpu", [0])
    else:
        from torch.distributed.device_mesh import DeviceMesh

        sub = DeviceMesh("cpu", [0])
    dt = side.module.DTensor.from_local(torch.ones(2, 3), sub, [side.Replicate()])
    summed = dt.sum()
    moved = (dt * 2).redistribute(sub, [side.Shard(0)])
    return {
        "from_local": (tuple(dt.to_local().shape), tuple(dt.shape)),
        "op": tuple((dt + 1).to_local().shape),
        "redistribute": tuple(moved.to_local().shape),
        "sum": (tuple(summed.to_local().shape), float(summed.to_local().sum())),
    }


def _both(world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ours, theirs = sides((world_size,))
    out: dict[str, Any] = {}
    for side in (ours, theirs):
        out[side.name] = {
            "cases": {case.name: run_case(side, case) for case in CASES},
            "errors": _errors(side),
            "prod": _partial_prod(side),
            "loss_parallel": _loss_parallel_nd(side),
            "outside": _outside_the_mesh(side),
        }
    return out


@world_sizes(2, 4)
def test_partial_items_like_torch(world_size: int) -> None:
    for got in run_on_ranks(_both, world_size, world_size, timeout_s=240.0):
        ours, theirs = got["hp"], got["torch"]
        # partial cases: placements and forward collectives are torch's
        assert_like_torch(ours["cases"], theirs["cases"], different={})
        # torch's "prod" spelling: accepted, the product over ranks, one all-reduce
        assert ours["prod"].get("close"), ours["prod"]
        assert ours["prod"]["comm"] == {"all_reduce": 1}, ours["prod"]
        assert theirs["prod"].get("close") or "raised" in theirs["prod"], theirs["prod"]
        # errors where torch raises: the same exception type
        for name, theirs_error in theirs["errors"].items():
            mine = ours["errors"][name]
            assert mine.split(":")[0] == theirs_error.split(":")[0], (name, mine, theirs_error)
        assert (
            "Please pass both shape and stride at the same time"
            in (ours["errors"]["from_local shape without stride"])
        )
        assert "sharded dimension 0" in ours["errors"]["unbind along the sharded dim"]
        # loss parallel on (N, C, d...) logits: torch's values, placements and collectives
        for key, mine_lp in ours["loss_parallel"].items():
            theirs_lp = theirs["loss_parallel"][key]
            assert mine_lp["close"] and mine_lp["grad_close"], (key, mine_lp)
            assert mine_lp["layout"] == theirs_lp["layout"], (key, mine_lp, theirs_lp)
            assert mine_lp["forward"] == theirs_lp["forward"], (key, mine_lp, theirs_lp)
            assert mine_lp["backward"] == theirs_lp["backward"], (key, mine_lp, theirs_lp)
        assert ours["outside"] == theirs["outside"], (ours["outside"], theirs["outside"])

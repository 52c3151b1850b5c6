"""Cases of torch's ``test_redistribute.py``, ``test_dtensor.py`` and ``test_init.py``, on both.

Ported in our words at the behaviours a user sees. Each scenario runs on hp-dtensor
and on torch.distributed.tensor with the same inputs, in one launch of 4 ranks, and
returns plain values: tensors (global values, checked against the one-process value
the scenario knows and against torch's), placements and collective counts (each
side's ``CommDebugMode``), which must equal torch's except where the README lists a
deliberate difference (``DIFFERENT``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tests._harness import run_on_ranks
from tests.dtensor._torch_twin import Side, assert_scenarios_like_torch, full, layout, sides

_G = torch.Generator().manual_seed(53)
_X = torch.randn(8, 6, generator=_G)
_UNEVEN = torch.randn(5, 3, generator=_G)


def _moved(side: Side, x: torch.Tensor, src: list[Any], dst: list[Any]) -> dict[str, Any]:
    """``redistribute`` from ``src`` to ``dst``, forward and backward (``test_redistribute``)."""
    dt = side.distribute(x.clone(), src).requires_grad_()
    with side.comm() as forward:
        out = dt.redistribute(side.mesh, dst)
    torch.autograd.backward((out * out).sum())
    assert dt.grad is not None
    return {
        "value": full(out).detach(),
        "want": x,
        "layout": layout(out),
        "forward": forward,
        "grad_layout": layout(dt.grad),
        "grad": full(dt.grad),  # 2 x, compared with torch's
    }


def _redistribute(side: Side) -> dict[str, Any]:
    S, R = side.Shard, side.Replicate
    out = {
        "S0 -> R": _moved(side, _X, [S(0)], [R()]),
        "R -> R": _moved(side, _X, [R()], [R()]),
        "R -> S0": _moved(side, _X, [R()], [S(0)]),
        "R -> S1": _moved(side, _X, [R()], [S(1)]),
        "S(-1) -> R": _moved(side, _X, [S(-1)], [R()]),
        "uneven S0 -> R": _moved(side, _UNEVEN, [S(0)], [R()]),
        "uneven R -> S1": _moved(side, _UNEVEN, [R()], [S(1)]),
    }
    for name, dst in (("P -> R", [R()]), ("P -> S0", [S(0)]), ("P -> S1", [S(1)])):
        rank = side.mesh.get_local_rank()
        part = side.from_local(_X * (rank + 1) / 10, [side.Partial()])
        with side.comm() as forward:
            moved = part.redistribute(side.mesh, dst)
        out[name] = {
            "value": full(moved),
            "want": _X,
            "layout": layout(moved),
            "forward": forward,
        }
    return out


def _redistribute_2d(side: Side) -> dict[str, Any]:
    """``test_redistribute``'s multi-dim mesh cases on a (2, 2) mesh."""
    S, R = side.Shard, side.Replicate
    out: dict[str, Any] = {}
    for name, src, dst in (
        ("[S0, S1] -> [R, R]", [S(0), S(1)], [R(), R()]),
        ("[R, S0] -> [S0, R]", [R(), S(0)], [S(0), R()]),
        ("[S0, R] -> [S0, S1]", [S(0), R()], [S(0), S(1)]),
        ("[S1, S0] -> [R, S0]", [S(1), S(0)], [R(), S(0)]),
    ):
        dt = side.distribute(_X.clone(), src)
        with side.comm() as forward:
            moved = dt.redistribute(side.mesh, dst)
        out[name] = {"value": full(moved), "want": _X, "layout": layout(moved), "forward": forward}
    # a Partial on one axis reduced while the other axis stays sharded
    rank = side.mesh.get_coordinate()[0]
    local = _X.chunk(2, dim=0)[side.mesh.get_coordinate()[1]] * (rank + 1) / 3
    part = side.from_local(local, [side.Partial(), S(0)])
    with side.comm() as forward:
        moved = part.redistribute(side.mesh, [R(), S(0)])
    out["[P, S0] -> [R, S0]"] = {
        "value": full(moved),
        "want": _X,
        "layout": layout(moved),
        "forward": forward,
    }
    return out


def _dtensor_api(side: Side) -> dict[str, Any]:
    """``test_dtensor``: constructor attributes, from_local/to_local with gradients, hints."""
    S, R, P = side.Shard, side.Replicate, side.Partial
    n = side.mesh.size()
    rank = side.mesh.get_local_rank()
    out: dict[str, Any] = {}
    dt = side.distribute(_X.clone(), [S(1)])
    out["attributes"] = {
        "shape": tuple(dt.shape),
        "stride": dt.stride(),
        "local": tuple(dt.to_local().shape),
        "dtype": dt.dtype,
        "requires_grad": dt.requires_grad,
        "ndim": dt.ndim,
        "numel": dt.numel(),
    }
    # from_local -> op -> to_local, gradients flow back to the local tensor
    local = (_X.chunk(n, 0)[rank]).clone().requires_grad_()
    with side.comm() as forward:
        made = side.from_local(local, [S(0)])
        doubled = (made * 2).to_local()
    torch.autograd.backward(doubled.sum())
    assert local.grad is not None
    out["from_local then to_local"] = {
        "value": doubled.detach(),
        "want": local.detach() * 2,
        "grad": local.grad,
        "forward": forward,
    }
    # uneven shards with explicit shape and stride
    rows = [2, 2, 1, 0] if n == 4 else [3, 2]
    start = sum(rows[:rank])
    piece = _UNEVEN[start : start + rows[rank]].clone()
    uneven = side.from_local(piece, [S(0)], shape=_UNEVEN.shape, stride=_UNEVEN.stride())
    with side.comm() as forward:
        value = uneven.full_tensor()
    out["from_local uneven"] = {"value": value, "want": _UNEVEN, "forward": forward}
    # full_tensor(grad_placements=[Partial()]): the gradient arrives Partial and is reduced
    leaf = side.distribute(_X.clone(), [S(0)]).requires_grad_()
    with side.comm() as backward:
        whole = leaf.full_tensor(grad_placements=[P()])
        torch.autograd.backward((whole * (rank + 1)).sum())
    assert leaf.grad is not None
    out["full_tensor grad hint"] = {
        "value": full(leaf.grad),
        "want": torch.full_like(_X, sum(range(1, n + 1))),
        "grad_layout": layout(leaf.grad),
        "backward": backward,
    }
    # to_local(grad_placements=[Partial()]) on a replicated DTensor
    rep = side.distribute(_X.clone(), [R()]).requires_grad_()
    with side.comm() as backward:
        torch.autograd.backward(rep.to_local(grad_placements=[P()]).sum() * (rank + 1))
    assert rep.grad is not None
    out["to_local grad hint"] = {
        "value": full(rep.grad),
        "want": torch.full_like(_X, sum(range(1, n + 1))),
        "grad_layout": layout(rep.grad),  # Partial, as torch: no collective in the backward
        "backward": backward,
    }
    # implicit replication: a plain tensor joins an op on a DTensor as Replicate
    sharded = side.distribute(_X.clone(), [S(0)])
    implicit: Any
    if side.name == "hp":
        import hyper_parallel.dtensor as hp

        implicit = hp.implicit_replication
    else:
        from torch.distributed.tensor.experimental import implicit_replication

        implicit = implicit_replication
    with implicit(), side.comm() as forward:
        summed = sharded + torch.ones(6)
    out["implicit replication"] = {
        "value": full(summed),
        "want": _X + 1,
        "layout": layout(summed),
        "forward": forward,
    }
    # torch.split / chunk along the sharded dim of a sharded DTensor
    pieces = torch.split(side.distribute(_X.clone(), [S(1)]), 3, dim=0)
    out["split along a replicated dim"] = {
        "value": torch.cat([full(p) for p in pieces]),
        "want": _X,
        "layout": layout(list(pieces)),
    }
    # new_empty_strided keeps the layout for the same size
    empty = dt.new_empty_strided(tuple(dt.shape), dt.stride())
    out["new_empty_strided"] = {"layout": layout(empty), "local": tuple(empty.to_local().shape)}
    return out


def _init(side: Side) -> dict[str, Any]:
    """``test_init``: ``nn.init`` fills and torch's factories on DTensors."""
    S = side.Shard
    out: dict[str, Any] = {}
    inits: dict[str, tuple[Callable[[Any], Any], torch.Tensor]] = {
        "constant_": (lambda t: torch.nn.init.constant_(t, 1.5), torch.full((8, 6), 1.5)),
        "ones_": (torch.nn.init.ones_, torch.ones(8, 6)),
        "zeros_": (torch.nn.init.zeros_, torch.zeros(8, 6)),
        "eye_ of a replicate": (torch.nn.init.eye_, torch.eye(8, 6)),
        "eye_ of row shards": (torch.nn.init.eye_, torch.eye(8, 6)),
    }
    for name, (fn, want) in inits.items():
        placements = [side.Replicate()] if "replicate" in name else [S(0)]
        dt = side.distribute(torch.randn(8, 6), placements)
        try:
            with side.comm() as forward:
                fn(dt)
        except (RuntimeError, NotImplementedError) as exc:  # torch has no rule for eye of shards
            out[name] = {"raised": type(exc).__name__}
            continue
        out[name] = {"value": full(dt), "want": want, "layout": layout(dt), "forward": forward}
    for name, factory in (("ones", "ones"), ("zeros", "zeros")):
        made = getattr(side.module, factory)(8, 6, device_mesh=side.mesh, placements=[S(1)])
        out[f"factory {name}"] = {
            "value": full(made),
            "want": getattr(torch, factory)(8, 6),
            "layout": layout(made),
            "local": tuple(made.to_local().shape),
        }
    full_made = side.module.full((5, 3), 2.0, device_mesh=side.mesh, placements=[S(0)])
    out["factory full uneven"] = {
        "value": full(full_made),
        "want": torch.full((5, 3), 2.0),
        "local": tuple(full_made.to_local().shape),
    }
    return out


# README, "Differences from torch": what hp-dtensor gives there
DIFFERENT: dict[tuple[str, str], Any] = {}


# torch raises for these (no sharding rule); hp's values are checked alone
TORCH_RAISES = frozenset({"eye_ of row shards"})


def _both() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for side in sides((4,)):
        out[side.name] = {
            "redistribute": _redistribute(side),
            "dtensor": _dtensor_api(side),
            "init": _init(side),
        }
    for side in sides((2, 2)):
        out[side.name]["redistribute 2-d"] = _redistribute_2d(side)
    return out


def test_torch_api_cases_like_torch() -> None:
    for got in run_on_ranks(_both, 4, timeout_s=300.0):
        assert_scenarios_like_torch(got["hp"], got["torch"], DIFFERENT, TORCH_RAISES)

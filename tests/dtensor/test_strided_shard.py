"""``_StridedShard``: torch's value semantics, and redistribution against torch's shards.

The oracle is torch's own ``_StridedShard`` on the same mesh: each rank's local shard of
``distribute_tensor(full, mesh, placements)`` (torch's split), and the full tensor itself
for every gather. Values are integers, so comparisons are exact.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.tensor as tdt
from tests._harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard

from hyper_parallel.dtensor import (
    CommDebugMode,
    Placement,
    Replicate,
    Shard,
    clip_grad_norm_,
    distribute_tensor,
    init_device_mesh,
    strict_mode,
)
from hyper_parallel.dtensor.fsdp._param_group import _strided_is_nested
from hyper_parallel.dtensor.placement_types import _StridedShard

SS = _StridedShard


def to_torch(p: Placement) -> tdt.Placement:
    """The torch placement of the same value."""
    if isinstance(p, _StridedShard):
        return TorchStridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    return tdt.Replicate()


def test_strided_shard_reads_like_torchs() -> None:
    for dim, sf in ((0, 2), (1, 4), (2, 1)):
        ours, theirs = SS(dim, split_factor=sf), TorchStridedShard(dim, split_factor=sf)
        assert (repr(ours), str(ours)) == (repr(theirs), str(theirs))
        assert (ours.dim, ours.split_factor) == (theirs.dim, theirs.split_factor)
        assert ours.is_shard() == theirs.is_shard() and ours.is_replicate() is False
        assert (ours == Shard(dim)) == (theirs == tdt.Shard(dim))  # type: ignore[comparison-overlap]
        assert isinstance(ours, Shard) == isinstance(theirs, tdt.Shard)
        assert SS(dim, sf=sf) is ours and hash(SS(dim, split_factor=sf)) == hash(ours)
        assert pickle.loads(pickle.dumps(ours)) is ours
        assert eval(repr(ours), {"_StridedShard": SS}) is ours
    assert SS(0, sf=2) != SS(0, sf=3)
    buffer = io.BytesIO()
    torch.save([SS(1, sf=4)], buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == [SS(1, sf=4)]  # a safe global, as torch's


# (mesh placements on ("dp", "tp") of 2 x 2, global shape): FSDP x TP's own layout, its
# halves, strided on the inner axis, on dim 1, and uneven sizes.
LAYOUTS: tuple[tuple[Placement, ...], ...] = (
    (SS(0, sf=2), Shard(0)),
    (SS(0, sf=2), Replicate()),
    (Replicate(), SS(0, sf=3)),
    (Shard(0), SS(0, sf=2)),
    (SS(1, sf=2), Shard(1)),
    (SS(0, sf=2), Shard(1)),
)
SHAPES: tuple[tuple[int, int], ...] = ((8, 6), (7, 5))
TARGETS: tuple[tuple[Placement, ...], ...] = (
    (Replicate(), Replicate()),
    (Shard(0), Shard(0)),
    (Replicate(), Shard(0)),
    (Shard(1), Replicate()),
    (SS(0, sf=2), Shard(0)),
    (Replicate(), SS(0, sf=3)),
)


def _shards_like_torch() -> list[str]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tmesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    failures: list[str] = []

    def torch_local(full: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
        laid = [to_torch(p) for p in placements]
        return tdt.distribute_tensor(full, tmesh, laid, src_data_rank=None).to_local()

    for shape in SHAPES:
        full = torch.arange(shape[0] * shape[1]).reshape(shape)
        for src in LAYOUTS:
            want = torch_local(full, src)
            for src_rank in (0, None):
                dt = distribute_tensor(full, mesh, src, src_data_rank=src_rank)
                if not torch.equal(dt.to_local(), want):
                    failures.append(f"distribute {shape} {src} src={src_rank}")
            if not torch.equal(dt.full_tensor(), full):
                failures.append(f"full_tensor {shape} {src}")
            for dst in TARGETS:
                with CommDebugMode() as comm:
                    moved = dt.redistribute(mesh, dst)
                if moved.placements != dst or not torch.equal(
                    moved.to_local(), torch_local(full, dst)
                ):
                    failures.append(f"redistribute {shape} {src} -> {dst}")
                back = moved.redistribute(mesh, src)
                if not torch.equal(back.to_local(), want):
                    failures.append(f"redistribute back {shape} {dst} -> {src}")
                if sum(comm.counts().values()) > 2:
                    failures.append(f"{src} -> {dst}: {comm.counts()}")
    return failures


def test_strided_shard_distribute_and_redistribute_match_torchs_shards_on_four_ranks() -> None:
    for failures in run_on_ranks(_shards_like_torch, 4, timeout_s=240):
        assert failures == []


def _optimizer_step_on_strided_params() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    # FSDP x TP's layout of a Colwise weight, an uneven one, and a Rowwise weight beside them
    shapes = {"w1": (8, 6), "w2": (10, 3), "w3": (4, 8)}
    layouts = {
        "w1": (SS(0, sf=2), Shard(0)),
        "w2": (SS(0, sf=2), Shard(0)),
        "w3": (Shard(0), Shard(1)),
    }
    full = {n: torch.randn(s) for n, s in shapes.items()}
    grads = {n: torch.randn(s) for n, s in shapes.items()}
    params: list[Any] = [
        torch.nn.Parameter(distribute_tensor(full[n], mesh, layouts[n])) for n in shapes
    ]
    for p, n in zip(params, shapes, strict=True):
        p.grad = distribute_tensor(grads[n], mesh, layouts[n])
    opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
    with strict_mode(), CommDebugMode() as comm:
        opt.step()
        doubled: Any = params[0] * 2 + params[0]  # pointwise, no collective
    one: list[Any] = [torch.nn.Parameter(full[n].clone()) for n in shapes]
    for p, n in zip(one, shapes, strict=True):
        p.grad = grads[n].clone()
    torch.optim.AdamW(one, lr=0.1, foreach=True).step()
    total = clip_grad_norm_(params, max_norm=0.5)
    one_total = torch.nn.utils.clip_grad_norm_(one, max_norm=0.5)
    return {
        "counts": comm.counts(),
        "placements": [mine.placements for mine in params] + [doubled.placements],
        "params": [
            torch.allclose(mine.full_tensor(), o.detach(), atol=1e-6)
            for mine, o in zip(params, one, strict=True)
        ],
        "doubled": torch.allclose(doubled.full_tensor(), params[0].full_tensor() * 3),
        "grads": [
            torch.allclose(mine.grad.full_tensor(), o.grad, atol=1e-6)
            for mine, o in zip(params, one, strict=True)
        ],
        "total": float(total),
        "one_total": float(one_total),
    }


def test_optimizer_step_and_clipping_keep_strided_params_local_on_four_ranks() -> None:
    for got in run_on_ranks(_optimizer_step_on_strided_params, 4, timeout_s=240):
        assert got["counts"] == {}, got
        assert got["placements"] == [
            (SS(0, sf=2), Shard(0)),
            (SS(0, sf=2), Shard(0)),
            (Shard(0), Shard(1)),
            (SS(0, sf=2), Shard(0)),
        ]
        assert got["params"] == [True] * 3 and got["grads"] == [True] * 3 and got["doubled"]
        assert abs(got["total"] - got["one_total"]) <= 1e-5 * abs(got["one_total"])


def test_fully_shard_writes_strided_exactly_where_it_names_the_rows_fsdp_holds() -> None:
    # Oracle: torch's own placement arithmetic against FSDP's rows (chunk i of TP shard j).
    for length in range(1, 12):
        for dp in (1, 2, 3, 4):
            for tp in (2, 3):
                agree = True
                for i in range(dp):
                    for j in range(tp):
                        tp_rows = torch.arange(length).chunk(tp)
                        mine = tp_rows[j].chunk(dp) if j < len(tp_rows) else ()
                        rows = mine[i] if i < len(mine) else torch.arange(0)
                        shape, offset = _compute_local_shape_and_global_offset(
                            (length,),
                            (dp, tp),
                            [i, j],
                            [TorchStridedShard(0, split_factor=tp), tdt.Shard(0)],
                        )
                        same = shape[0] == len(rows) and (not len(rows) or offset[0] == rows[0])
                        agree = agree and same
                assert _strided_is_nested(length, dp, tp) == agree, (length, dp, tp)
    assert not _strided_is_nested(7, 3, 2)  # the case the README names


def _views_on_both() -> list[tuple[str, Any, Any, dict[str, int], int, bool, bool]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    tmesh = torch_init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    a, w = torch.randn(8, 4, 6), torch.randn(6, 5)
    cases: list[tuple[str, Any, tuple[torch.Tensor, ...], tuple[Placement, ...]]] = [
        ("flatten of S2", lambda t: t.flatten(), (a,), (Shard(2),)),
        ("flatten(0, 1) of S1", lambda t: t.flatten(0, 1), (a,), (Shard(1),)),
        ("reshape(32, 6) of S1", lambda t: t.reshape(32, 6), (a,), (Shard(1),)),
        (
            "flatten then unflatten",
            lambda t: t.flatten().unflatten(0, (8, 4, 6)),
            (a,),
            (Shard(2),),
        ),
        ("matmul of 3-d S1 by 2-d", torch.matmul, (a, w), (Shard(1), Replicate())),
    ]
    out = []
    for name, fn, args, placements in cases:
        ours = [
            distribute_tensor(x.clone().requires_grad_(), mesh, [p])
            for x, p in zip(args, placements, strict=True)
        ]
        theirs = [
            tdt.distribute_tensor(x.clone().requires_grad_(), tmesh, [to_torch(p)])
            for x, p in zip(args, placements, strict=True)
        ]
        with CommDebugMode() as comm:
            got = fn(*ours)
            got.sum().backward()
        with TorchCommDebugMode() as tcomm:  # type: ignore[no-untyped-call]
            want = fn(*theirs)
            want.sum().backward()
        leaves = [x.clone().requires_grad_() for x in args]
        fn(*leaves).sum().backward()
        grads_ok = all(
            torch.allclose(o.grad.full_tensor(), leaf.grad, atol=1e-5)  # type: ignore[union-attr,arg-type]
            for o, leaf in zip(ours, leaves, strict=True)
        )
        out.append(
            (
                name,
                repr(got.placements),
                repr(want.placements),
                comm.counts(),
                tcomm.get_total_counts(),
                torch.allclose(got.full_tensor(), fn(*args), atol=1e-5),
                grads_ok,
            )
        )
    return out


def test_views_and_matmul_keep_strided_shards_as_torch_with_no_collective_on_two_ranks() -> None:
    for results in run_on_ranks(_views_on_both, 2, timeout_s=240):
        for name, ours, theirs, counts, torch_count, values_ok, grads_ok in results:
            assert ours == theirs, (name, ours, theirs)
            assert values_ok and grads_ok, name
            # never more than torch. The matmul's replicated weight: torch all-gathers in
            # the backward (1) and gives it a Replicate gradient; hp multiplies the local
            # shards and leaves the gradient Partial (0), reduced once by its reader (the
            # optimizer's step, clip; hp-dtensor README, "gradient of a leaf")
            assert sum(counts.values()) <= torch_count, (name, counts, torch_count)
            if name != "matmul of 3-d S1 by 2-d":
                assert sum(counts.values()) == torch_count, (name, counts, torch_count)

"""Expert parallelism: the MoE layer on ep=2/4 (with etp=tp, with FSDP of experts on efsdp,
with ep borrowing tp's ranks on tp-replicated or sequence-parallel input) equals one process
computing the whole batch, for 3 steps (outputs, input, router and expert gradients, the
aux-loss-free bias); DCP checkpoints reshard across ep; the collectives are counted; bad
layouts and inputs are refused on every rank before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import ParallelDims, ShardingError
from hyper_parallel.dmodule.layers import MoE, update_load_balance
from hyper_parallel.dtensor import (
    CommDebugMode,
    DTensor,
    Partial,
    Replicate,
    Shard,
    clip_grad_norm_,
    collectives,
    distribute_tensor,
)
from hyper_parallel.dtensor.fsdp import fully_shard

DIM, BATCH, SEQ = 16, 8, 3  # BATCH: the global batch, split over the batch ranks
LR = 0.5


def _config(**fields: Any) -> MoE.Config:
    base: dict[str, Any] = {
        "dim": DIM,
        "hidden_dim": 8,
        "num_experts": 4,
        "top_k": 2,
        "load_balance_coeff": 0.05,
    }
    base.update(fields)
    return MoE.Config(**base)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _ep_steps(
    dims_kwargs: dict[str, Any], fields: dict[str, Any], fsdp: bool, tp_input: str = ""
) -> None:
    """3 SGD steps under ``dims`` against the same 3 steps on the full batch in this process.

    ``tp_input``: the batch rank's rows arrive as a DTensor on the ``tp`` view,
    ``"replicate"`` (whole on each tp rank) or ``"sequence"`` (``Shard(1)``, uneven).
    """
    torch.set_num_threads(1)
    dims = ParallelDims(**dims_kwargs)
    cfg = _config(**fields)
    torch.manual_seed(0)
    ref = cfg.build()
    ref.init_states()
    with torch.device("meta"):
        model = cfg.build()
    model.parallelize(dims)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_states()  # on meta, then parallelized: one device's values
    for (name, mine), (_, want) in zip(
        model.state_dict().items(), ref.state_dict().items(), strict=True
    ):
        assert torch.equal(_full(mine), want), name
    assert isinstance(model.experts.w1, DTensor)
    assert model.experts.w1.to_local().shape[0] == 4 // dims.ep
    if fsdp:
        experts_fsdp = fully_shard(model.experts, mesh=dims.efsdp_mesh)
        # an expert's gradient already sums the tokens of its ep group: divide by every data rank
        experts_fsdp.set_gradient_divide_factor(float(dims.dp))
        fully_shard(model, mesh=dims.fsdp_mesh)
    batch_mesh = dims.batch_mesh
    rank, ranks = batch_mesh.get_local_rank("batch"), batch_mesh.size()
    rows = slice(rank * BATCH // ranks, (rank + 1) * BATCH // ranks)
    for step in range(3):
        torch.manual_seed(100 + step)
        x, target = torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, DIM)
        mine = _tp_share(x[rows], dims, tp_input)  # this rank's part of its batch rows
        xs = x[rows][mine].clone().requires_grad_()
        out = model(_as_tp_input(xs, dims, tp_input))
        # each rank: the mean over its own rows; the reference: the mean over the batch
        # (sequence parallel: each tp rank adds its shard's share of that mean)
        ((_local(out) * target[rows][mine]).sum() / (BATCH // ranks)).backward()  # type: ignore[no-untyped-call]
        xr = x.clone().requires_grad_()
        want = ref(xr)
        ((want * target).sum() / BATCH).backward()
        assert_close_to_scale(_local(out), want[rows][mine], rel=1e-5)
        assert xs.grad is not None and xr.grad is not None
        assert_close_to_scale(xs.grad, xr.grad[rows][mine] * ranks, rel=1e-5)
        if fsdp:  # gradients on the dense and the expert meshes: one norm, torch's
            norm = clip_grad_norm_(list(model.parameters()), max_norm=1e9)
            want_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=1e9)
            assert_close_to_scale(_full(norm), want_norm, rel=1e-5)
        with torch.no_grad():
            for (name, p), (_, q) in zip(
                model.named_parameters(), ref.named_parameters(), strict=True
            ):
                assert p.grad is not None and q.grad is not None, name
                grad = _full(p.grad)
                routed = name.startswith("experts.") and dims.ep > 1
                if not fsdp and not routed:  # replicated: average over the data ranks
                    grad = collectives.all_reduce(grad, batch_mesh, "batch", "avg")
                elif not fsdp:  # an expert: its owner summed the mean losses of its ep group
                    efsdp = dims.get_mesh("efsdp")
                    grad = collectives.all_reduce(grad, efsdp, "efsdp", "sum") / ranks
                assert_close_to_scale(grad, q.grad, rel=1e-5, what=name)
                q.sub_(LR * q.grad)
                mine = (
                    distribute_tensor(q, p.device_mesh, p.placements, src_data_rank=None)
                    if isinstance(p, DTensor)
                    else q
                )
                _local(p).copy_(_local(mine))
                p.grad = q.grad = None
        update_load_balance(model, dims)
        update_load_balance(ref)
        assert model.expert_bias is not None and ref.expert_bias is not None
        assert_close_to_scale(model.expert_bias, ref.expert_bias, rel=1e-6)
    assert ref.expert_bias is not None and float(ref.expert_bias.abs().sum()) > 0


def _tp_share(rows: torch.Tensor, dims: ParallelDims, tp_input: str) -> tuple[slice, ...]:
    """The index of this rank's part of ``rows``: its sequence chunk under ``"sequence"``."""
    if tp_input != "sequence":
        return (slice(None),)
    tp = dims.get_mesh("tp")
    rank, size = tp.get_local_rank("tp"), tp.size()
    step = -(-rows.shape[1] // size)  # torch.chunk's: ceil, the last chunks shorter or empty
    return (
        slice(None),
        slice(min(rank * step, rows.shape[1]), min((rank + 1) * step, rows.shape[1])),
    )


def _as_tp_input(xs: torch.Tensor, dims: ParallelDims, tp_input: str) -> torch.Tensor:
    if not tp_input:
        return xs
    tp = dims.get_mesh("tp")
    if tp_input == "replicate":
        return DTensor.from_local(xs, tp, [Replicate()])
    shape = (xs.shape[0], SEQ, DIM)
    return DTensor.from_local(xs, tp, [Shard(1)], shape=shape, stride=(SEQ * DIM, DIM, 1))


@pytest.mark.parametrize(
    ("dims_kwargs", "fields", "fsdp"),
    [
        ({"ep": 2}, {"score_func": "softmax"}, False),
        ({"ep": 4}, {"score_func": "sigmoid", "route_norm": True}, False),
        ({"ep": 4}, {"shared_hidden_dim": 8}, False),
        (
            {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 2},
            {"shared_hidden_dim": 8, "expert_tensor_parallel": True},
            False,
        ),
        ({"ep": 2}, {}, True),
    ],
    ids=["ep2-softmax", "ep4-sigmoid", "ep4-shared", "ep2-etp2", "ep2-fsdp-efsdp2"],
)
def test_moe_under_ep_equals_one_process(
    dims_kwargs: dict[str, Any], fields: dict[str, Any], fsdp: bool
) -> None:
    run_on_ranks(_ep_steps, 4, dims_kwargs, fields, fsdp, timeout_s=240)


def _count_all_to_all() -> tuple[dict[str, int], list[Any]]:
    torch.set_num_threads(1)
    dims = ParallelDims(ep=4)
    torch.manual_seed(0)
    model = _config().build()
    model.init_states()
    model.parallelize(dims)
    x = torch.randn(2, SEQ, DIM, requires_grad=True)
    with CommDebugMode() as comm:
        model(x).sum().backward()
    return comm.counts(), [(r.kind, r.mesh_axis) for r in comm.records()]


def test_ep_moves_tokens_by_three_all_to_alls_forward_and_one_back() -> None:
    counts, records = run_on_ranks(_count_all_to_all, 4, timeout_s=240)[0]
    # forward: the counts, the tokens out, the outputs back; backward: both token moves
    assert counts == {"all_to_all": 5}
    assert all(r == ("all_to_all", "ep") for r in records)


def _save(directory: str) -> dict[str, torch.Tensor]:
    from hyper_parallel.dmodule.checkpoint import ModelState, save

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = _config(shared_hidden_dim=8).build()
    model.init_states()
    assert model.expert_bias is not None
    model.expert_bias.copy_(torch.arange(4.0))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    model.parallelize(ParallelDims(ep=2))
    save({"app": ModelState(model)}, directory, step=1)
    return full


def _load(directory: str, ep: int) -> dict[str, torch.Tensor]:
    from hyper_parallel.dmodule.checkpoint import ModelState, load

    torch.set_num_threads(1)
    torch.manual_seed(2)
    model = _config(shared_hidden_dim=8).build()
    model.init_states()
    if ep > 1:
        model.parallelize(ParallelDims(ep=ep))
    load({"app": ModelState(model)}, directory)
    return {k: _full(v).clone() for k, v in model.state_dict().items()}


def test_checkpoint_saved_on_ep2_loads_on_ep4_and_one_process(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save, 4, directory, timeout_s=240)[0]
    for got in (
        run_on_ranks(_load, 4, directory, 4, timeout_s=240)[0],
        run_on_ranks(_load, 1, directory, 1, timeout_s=240)[0],
    ):
        assert got.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(got[name], value), name


def _bad_num_experts() -> str:
    torch.set_num_threads(1)
    model = _config(num_experts=6, top_k=2).build()
    model.init_states()
    before = model.experts.w1.detach().clone()
    try:
        model.parallelize(ParallelDims(ep=4))
    except ShardingError as error:
        assert not isinstance(model.experts.w1, DTensor)
        assert torch.equal(model.experts.w1, before) and not model.is_parallelized
        return str(error)
    return "no error"


def test_num_experts_not_divisible_by_ep_is_refused_on_every_rank() -> None:
    for message in run_on_ranks(_bad_num_experts, 4, timeout_s=240):
        assert "num_experts=6 is not divisible by the size of mesh axis 'ep' (4)" in message
        assert "GroupedExperts at 'experts'" in message


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"dp_shard": 2, "tp": 2, "ep": 4, "etp": 2, "world_size": 4}, "ep=4 must divide"),
        ({"dp_shard": 2, "tp": 2, "ep": 2, "etp": 3, "world_size": 4}, "etp must be 1 or tp"),
    ],
)
def test_ep_layouts_that_do_not_fit_the_ranks_are_refused(
    kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        ParallelDims(**kwargs)


def _ep_borrowing_tp() -> dict[str, Any]:
    """ep spanning tp's ranks (etp=1) on both input layouts, the other expert layouts on
    sequence-parallel input, FSDP of (ep, etp) experts; the collectives; the refusals."""
    torch.set_num_threads(1)
    borrowed = {"dp_shard": 2, "tp": 2, "ep": 2}
    _ep_steps(borrowed, {"score_func": "softmax", "shared_hidden_dim": 8}, False, "replicate")
    _ep_steps(borrowed, {"score_func": "sigmoid", "route_norm": True}, False, "sequence")
    _ep_steps({"tp": 4, "ep": 4}, {"aux_loss_coeff": 0.01}, False, "replicate")
    _ep_steps({"tp": 4, "ep": 4}, {}, False, "sequence")  # SEQ=3 over 4: one rank has none
    # experts whole on each tp rank (split by etp, or not at all): sequence shards gathered
    etp = {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 2}
    _ep_steps(etp, {"expert_tensor_parallel": True}, False, "sequence")
    _ep_steps({"dp_shard": 2, "tp": 2}, {}, False, "sequence")
    # experts on the 2-D (ep, etp) view under fully_shard over efsdp (size 1 on 4 ranks)
    _ep_steps(etp, {"expert_tensor_parallel": True}, True)
    dims = ParallelDims(**borrowed)
    torch.manual_seed(0)
    model = _config().build()
    model.init_states()
    model.parallelize(dims)
    found: dict[str, Any] = {}
    for tp_input in ("replicate", "sequence"):
        xs = torch.randn(2, SEQ, DIM)[_tp_share(torch.empty(2, SEQ), dims, tp_input)]
        x = _as_tp_input(xs.requires_grad_(), dims, tp_input)
        with CommDebugMode() as comm:
            out = model(x)
            forward = [(r.kind, r.mesh_axis) for r in comm.records()]
            _local(out).sum().backward()  # type: ignore[no-untyped-call]
        found[tp_input] = (forward, [(r.kind, r.mesh_axis) for r in comm.records()][len(forward) :])
    tp = dims.get_mesh("tp")
    bad = {
        "partial": DTensor.from_local(torch.randn(2, SEQ, DIM), tp, [Partial()]),
        "features": DTensor.from_local(torch.randn(2, SEQ, DIM // 2), tp, [Shard(2)]),
        "replicated-dp": DTensor.from_local(
            torch.randn(2, SEQ, DIM), dims.get_mesh(("dp_shard", "tp")), [Replicate(), Replicate()]
        ),
    }
    assert model.tokens_per_expert is not None
    update_load_balance(model, dims)  # counts back to zero
    for name, x in bad.items():
        try:
            model(x)
            found[name] = "no error"
        except ValueError as error:
            found[name] = str(error)
        assert not model.tokens_per_expert.any(), name  # refused before routing anything
    return found


def test_ep_borrowing_tp_splits_tokens_over_tp_and_equals_one_process() -> None:
    """etp=1: ep takes tp's ranks; tp-replicated or sequence-parallel tokens are each routed
    once, the router gradient whole on every tp rank (TorchTitan's TP2EP)."""
    for found in run_on_ranks(_ep_borrowing_tp, 4, timeout_s=240):
        a2a, gather = [("all_to_all", "ep")] * 3, ("all_gather", "tp")
        # replicated: the experts' share goes out; the outputs are all-gathered over tp; the
        # backward gathers the shares' gradients of the tokens and the routing weights
        assert found["replicate"] == ([*a2a, gather], [*a2a[:2], gather, gather])
        # sequence parallel: the router's tokens all-gathered; the output stays the shard
        assert found["sequence"] == ([gather, *a2a], [*a2a[:2], gather])
        assert "Partial(reduce_op='sum') over mesh axis 'tp' (2 ranks)" in found["partial"]
        assert "not Partial or the feature dim 2" in found["features"]
        assert "replicated over mesh axis 'dp_shard' (2 ranks)" in found["replicated-dp"]

"""hp's fully_shard of a parameter on a 2-D (ep, tp) mesh trains as torch's FSDP2 and as one process.

Expert weights split over ``ep`` (experts) and ``tp`` (hidden units), FSDP-sharded over
``dp``: torch 2.14 composes FSDP with such a 2-D inner mesh (``_spmd_mesh`` of 3 axes,
``_StridedShard`` on ``dp`` when ``ep`` splits FSDP's dim). Oracles: torch's
``fully_shard`` on the same ranks, mesh, weights and batches (losses, gradients,
parameters, local shards, placements, collectives) and one process on the global batch.
Both 2-D meshes with one axis of size 1: (dp, ep, tp) = (2, 2, 1) and (2, 1, 2).
"""

from __future__ import annotations

from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dtensor._fsdp_cases import fsdp_of, layout
from tests.dtensor._tp_examples import HP, TORCH, Api, collective_counts
from torch import nn

EXPERTS, HIDDEN, DIM = 6, 4, 5  # 6 experts over ep=2, 3 each: FSDP's chunks of them uneven
BATCH, STEPS = 4, 2


class Experts(nn.Module):
    """A dense input projection, then every expert's ``[HIDDEN, DIM]`` weight on every row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, DIM)
        self.w = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.full_tensor() if hasattr(self.w, "full_tensor") else self.w
        return torch.einsum("nd,ehd->neh", self.inp(x), w)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (STEPS, BATCH, EXPERTS, HIDDEN)
    return torch.randn(STEPS, BATCH, 3, generator=g), torch.randn(*shape, generator=g)


def _train(api: Api | None, shape: tuple[int, int, int]) -> dict[str, Any]:
    """Two AdamW steps; ``api`` None: one process on the global batch."""
    torch.manual_seed(0)
    model = Experts()
    rank, size = 0, 1
    if api is not None:
        dt = api.dtensor
        mesh = dt.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep", "tp"))
        inner = mesh["ep", "tp"]
        w = dt.distribute_tensor(model.w.detach(), inner, [dt.Shard(0), dt.Shard(1)])
        model.w = nn.Parameter(w)
        fsdp_of(api).fully_shard(model, mesh=mesh["dp"])
        rank, size = mesh.get_local_rank("dp"), mesh.size(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    xs, ys = _batches()
    per = BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    out: dict[str, Any] = {"grads": [], "counts": None}
    for step in range(STEPS):
        counter = api.comm_debug_mode() if api is not None else None
        if counter is not None:
            counter.__enter__()
        loss = nn.functional.mse_loss(model(xs[step, rows]), ys[step, rows])
        loss.backward()  # type: ignore[no-untyped-call]
        if counter is not None:
            counter.__exit__(None, None, None)
            if step == 0:
                out["counts"] = collective_counts(counter)
        out["grads"].append(
            {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    if api is not None:
        out["layouts"] = {n: layout(p) for n, p in model.named_parameters()}
        out["locals"] = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    return out


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _both_layouts() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"one": _train(None, (1, 1, 1))}
    for shape in ((2, 2, 1), (2, 1, 2)):
        for api in (HP, TORCH):
            out[f"{shape}/{api.name}"] = _train(api, shape)
    return out


def test_fully_shard_over_dp_of_an_ep_by_tp_parameter_matches_torch_and_one_process() -> None:
    for rank, got in enumerate(run_on_ranks(_both_layouts, 4, timeout_s=240)):
        one = got["one"]
        for shape in ((2, 2, 1), (2, 1, 2)):
            hp, tt = got[f"{shape}/hp"], got[f"{shape}/torch"]
            what = f"rank {rank} (dp, ep, tp) = {shape}"
            for step in range(STEPS):
                for n, want in one["grads"][step].items():
                    assert_close_to_scale(hp["grads"][step][n], want, what=f"{what} grad {n}")
                    assert_close_to_scale(tt["grads"][step][n], want, what=f"{what} torch {n}")
            for n, want in one["params"].items():
                assert_close_to_scale(hp["params"][n], want, what=f"{what} param {n}")
            assert hp["layouts"] == tt["layouts"], (what, hp["layouts"], tt["layouts"])
            for n, want in tt["locals"].items():
                assert_close_to_scale(hp["locals"][n], want, what=f"{what} shard {n}")
            assert hp["counts"] == tt["counts"], (what, hp["counts"], tt["counts"])
        # ep splits FSDP's dim 0: torch's strided placement on dp; tp splits dim 1: plain Shard
        strided = ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)", "Shard(dim=1)")
        assert got["(2, 2, 1)/hp"]["layouts"]["w"] == (("dp", "ep", "tp"), strided)
        plain = ("Shard(dim=0)", "Shard(dim=0)", "Shard(dim=1)")
        assert got["(2, 1, 2)/hp"]["layouts"]["w"] == (("dp", "ep", "tp"), plain)

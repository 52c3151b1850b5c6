"""One small model trained under FSDP, HSDP or FSDP x TP, on torch's FSDP2 or on hp's.

The same code runs on both sides through an :class:`~tests.dtensor._tp_examples.Api`
namespace plus the side's ``fully_shard``; :func:`one_process` trains the same model on
the global batch in this process: the oracle both sides must match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from tests.dtensor._tp_examples import HP, TORCH, Api, collective_counts
from torch import nn

import hyper_parallel.dtensor.fsdp as hp_fsdp

__all__ = ["Model", "apply", "fsdp_of", "global_batch", "layout", "one_process", "train"]

BATCH = 8  # global batch; every data-parallel rank takes an equal slice
STEPS = 2


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))  # type: ignore[no-any-return]


class Model(nn.Module):
    """Two residual MLP blocks between an input projection and a head; dims uneven over 4."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block(8, 10), Block(8, 10)])
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, BATCH, 6, generator=g), torch.randn(STEPS, BATCH, 3, generator=g)


def fsdp_of(api: Api) -> Any:
    return hp_fsdp if api is HP else torch_fsdp


def apply(
    api: Api,
    model: Model,
    shape: tuple[int, ...],
    mode: str,
    src_data_rank: int | None = 0,
    **kwargs: Any,
) -> Any:
    """Shard ``model`` as ``mode`` ("fsdp", "hsdp", "fsdp_tp") on a mesh of ``shape``; the mesh."""
    fsdp = fsdp_of(api)
    names = {"fsdp": ("dp",), "hsdp": ("rep", "dp"), "fsdp_tp": ("dp", "tp")}[mode]
    mesh = api.dtensor.init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh
    if mode == "fsdp_tp":
        tp = api.parallel
        for block in model.blocks:
            tp.parallelize_module(
                block,
                mesh["tp"],
                {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()},
                src_data_rank=src_data_rank,
            )
        dp_mesh = mesh["dp"]
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=dp_mesh, **kwargs)
    fsdp.fully_shard(model, mesh=dp_mesh, **kwargs)
    return mesh


def _dp_rank_and_size(mesh: Any, mode: str) -> tuple[int, int]:
    if mode == "fsdp":
        return mesh.get_local_rank(0), mesh.size(0)
    if mode == "hsdp":
        return mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1), mesh.size()
    return mesh.get_local_rank("dp"), mesh.size(0)


def train(api: Api, shape: tuple[int, ...], mode: str, **kwargs: Any) -> dict[str, Any]:
    """Two AdamW steps on this rank's batch slice: losses, grads, params, layouts, counts."""
    torch.manual_seed(0)
    model = Model()
    mesh = apply(api, model, shape, mode, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    xs, ys = global_batch()
    rank, size = _dp_rank_and_size(mesh, mode)
    per = BATCH // size
    out: dict[str, Any] = {"loss": [], "grads": [], "counts": None, "layouts": {}}
    for step in range(STEPS):
        x, y = xs[step, rank * per : (rank + 1) * per], ys[step, rank * per : (rank + 1) * per]
        with api.comm_debug_mode() as comm:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
        if step == 0:
            out["counts"] = collective_counts(comm)
        loss_t = loss.detach().clone()  # the mean of the dp ranks' losses (tp ranks agree)
        torch.distributed.all_reduce(loss_t)
        out["loss"].append(float(loss_t) / torch.distributed.get_world_size())
        grads: dict[str, Any] = {n: p.grad for n, p in model.named_parameters()}
        out["grads"].append({n: g.full_tensor().clone() for n, g in grads.items()})
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        out["layouts"][n] = layout(p)
    params: dict[str, Any] = dict(model.named_parameters())
    out["params"] = {n: p.full_tensor().detach().clone() for n, p in params.items()}
    out["locals"] = {n: p.to_local().detach().clone() for n, p in params.items()}
    return out


def layout(p: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A DTensor's mesh axis names and placements as plain strings (either side)."""
    placements = tuple(repr(x) for x in p.placements)
    return tuple(p.device_mesh.mesh_dim_names), placements


def one_process() -> dict[str, Any]:
    """The same two steps on one process holding the full model and the global batch."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    xs, ys = global_batch()
    out: dict[str, Any] = {"loss": [], "grads": []}
    for step in range(STEPS):
        loss = nn.functional.mse_loss(model(xs[step]), ys[step])
        loss.backward()  # type: ignore[no-untyped-call]
        out["loss"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


SIDES = (HP, TORCH)

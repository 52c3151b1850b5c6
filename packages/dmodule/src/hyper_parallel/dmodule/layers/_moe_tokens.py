"""How MoE tokens travel: their layout over ``tp``, the all-to-alls over ``ep``, the sums over ``etp``.

Every collective goes through :mod:`hyper_parallel.dtensor.collectives` (directly, or by a
DTensor redistribution), so ``CommDebugMode`` counts them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, collectives

EP = MeshAxisName.EP
ETP = "etp"  # not a MeshAxisName member: those are upstream's values
TP_AXIS = axis_name(MeshAxisName.TP)


class _Experts(Protocol):
    """What the token paths use of ``GroupedExperts`` (moe.py, which imports this file).

    Its first weight (whose mesh says how ``ep``/``etp`` split the experts) and its call on
    tokens grouped by expert with the count per local expert.
    """

    @property
    def w1(self) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or (str(i) for i in range(mesh.ndim)))


def _token_layout(experts: _Experts, x: DTensor) -> tuple[int, bool] | None:
    """Where ``x``'s tokens lie over ``tp`` and whether each tp rank runs only its share.

    None: no ``tp`` axis of more than one rank (the tokens on each rank are its own).
    Else ``(tp's index in x's mesh, split)``: ``split`` when the experts are split over
    ``ep`` and not ``etp`` (``ParallelDims(etp=1)``, where ``ep`` borrows ``tp``'s ranks,
    as TorchTitan's): each tp rank sends 1/tp of the tokens to the experts, and the
    outputs are gathered back. Otherwise (experts whole, or split by ``etp``) every tp
    rank runs every token, as the replicated or hidden-split experts expect.

    Raises, before anything runs, for a ``Partial`` input or one split over its feature
    dim (no rank holds a whole token), and for an input replicated over an axis other
    than ``tp`` while the experts are split over ``ep`` only (each token would reach its
    experts once per rank of that axis).
    """
    names = _axis_names(x.device_mesh)
    _, ep, etp = _expert_axes(experts)
    tp_axis = None
    for i, placement in enumerate(x.placements):
        size = x.device_mesh.size(i)
        if size == 1:
            continue
        feature_split = isinstance(placement, Shard) and placement.dim % x.ndim == x.ndim - 1
        if isinstance(placement, Partial) or feature_split:
            raise ValueError(
                f"MoE: the input is {placement} over mesh axis {names[i]!r} ({size} ranks); "
                "expected whole tokens on each rank: Replicate() or Shard of a token dim "
                f"(e.g. sequence-parallel Shard(1)), not Partial or the feature dim {x.ndim - 1}"
            )
        if names[i] == TP_AXIS:
            tp_axis = i
        elif isinstance(placement, Replicate) and ep and not etp:
            raise ValueError(
                f"MoE: the input is replicated over mesh axis {names[i]!r} ({size} ranks) "
                "while the experts are split over 'ep' only, so each token would reach its "
                "experts once per rank of that axis; expected distinct tokens per rank "
                f"(Shard of a token dim) on every axis but {TP_AXIS!r}, whose tokens the "
                "layer shares out itself"
            )
    if tp_axis is None:
        return None
    return tp_axis, ep and not etp


def _take_share(t: torch.Tensor, mesh: DeviceMesh, share: Shard) -> torch.Tensor:
    """This rank's ``share`` of ``t``, whole on every rank of the 1-D ``mesh``.

    The gradient, one share per rank, is all-gathered back whole (``Replicate`` -> ``Shard``
    and back, torch's redistribute), so what reads ``t`` whole gets every token's.
    """
    spread = DTensor.from_local(t, mesh, [Replicate()]).redistribute(mesh, [share])
    return spread.to_local()


def _gather_shares(
    t: torch.Tensor, mesh: DeviceMesh, share: Shard, shape: tuple[int, ...]
) -> torch.Tensor:
    """Every rank's ``share`` of the 1-D ``mesh`` all-gathered into the whole ``shape``.

    The gradient, whole on every rank (the output is replicated), comes back as this
    rank's share.
    """
    stride = tuple(torch.empty(shape, device="meta").stride())
    shares = DTensor.from_local(t, mesh, [share], shape=shape, stride=stride)
    return shares.redistribute(mesh, [Replicate()]).to_local()


def _expert_axes(experts: _Experts) -> tuple[DeviceMesh | None, bool, bool]:
    """The mesh of the expert weights and whether ``ep`` / ``etp`` split them (size > 1)."""
    w1 = experts.w1
    if not isinstance(w1, DTensor):
        return None, False, False
    mesh = w1.device_mesh
    names = mesh.mesh_dim_names or ()
    ep = EP in names and mesh.size(names.index(EP)) > 1
    etp = ETP in names and mesh.size(names.index(ETP)) > 1
    return mesh, ep, etp


def _run_experts(experts: _Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts' outputs for ``x`` grouped by expert (``counts`` per global expert).

    Under expert parallelism: one all-to-all of the counts, one of the tokens to the ranks
    owning their experts, the experts there, and one all-to-all back; with ``etp`` the
    hidden units are split over its ranks and the partial outputs summed.
    """
    mesh, ep, etp = _expert_axes(experts)
    if mesh is None or not (ep or etp):
        plain: torch.Tensor = experts(x, counts)
        return plain
    if not ep:
        summed: torch.Tensor = _SumForward.apply(experts(_SumBackward.apply(x, mesh), counts), mesh)
        return summed
    ep_size = mesh.size(list(mesh.mesh_dim_names or ()).index(EP))
    local_experts = counts.shape[0] // ep_size
    send_counts = counts.reshape(ep_size, local_experts)
    # [source rank, local expert]: how many tokens each rank sends to each of my experts
    recv_counts = collectives.all_to_all(send_counts, mesh, EP)
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = _AllToAll.apply(x, recv_splits, send_splits, mesh)
    # received rows are (source rank, local expert)-major: regroup them expert-major
    by_expert = _group_by_expert(recv_counts)
    grouped = received[by_expert]
    if etp:
        grouped = _SumBackward.apply(grouped, mesh)
    out = experts(grouped, recv_counts.sum(0))
    if etp:
        out = _SumForward.apply(out, mesh)
    inverse = torch.empty_like(by_expert)
    inverse[by_expert] = torch.arange(by_expert.numel())
    back = out[inverse]
    returned: torch.Tensor = _AllToAll.apply(back, send_splits, recv_splits, mesh)
    return returned


def _group_by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder (source, expert)-major chunks of ``recv_counts`` expert-major."""
    sizes = recv_counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # where each (source, expert) chunk begins
    by_expert_sizes = recv_counts.t().reshape(-1)
    by_expert_starts = starts.reshape(recv_counts.shape).t().reshape(-1)
    placed = torch.cumsum(by_expert_sizes, 0) - by_expert_sizes  # where it lands
    shift = torch.repeat_interleave(by_expert_starts - placed, by_expert_sizes)
    return shift + torch.arange(shift.numel())


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows over ``ep``; the backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], mesh: DeviceMesh
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.mesh = mesh
        return collectives.all_to_all_single(x, out_splits, in_splits, mesh, EP)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = collectives.all_to_all_single(grad.contiguous(), in_splits, out_splits, ctx.mesh, EP)
        return back, None, None, None


class _SumForward(torch.autograd.Function):
    """Partial sums over ``etp`` made whole; the gradient, already whole, passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return collectives.all_reduce(x, mesh, ETP, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Identity forward; the gradient, a partial sum over ``etp`` (one hidden shard each), summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return collectives.all_reduce(grad, ctx.mesh, ETP, "sum"), None

"""Autograd through from_local, to_local, redistribute and full_tensor; leaf gradient layouts.

Gradient values are checked against the single-process oracle and gradient
placements against torch.distributed.tensor running the same graph on the same ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor.test_redistribute import oracle_shard
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from hyper_parallel.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    collectives,
    distribute_tensor,
    init_device_mesh,
)


def short(placements: Any) -> str:
    """Placements of either library as a short string: ``S0``, ``R``, ``P``."""
    names = []
    for p in placements:
        if p.is_shard():
            names.append(f"S{p.dim}")
        elif p.is_partial():
            names.append("P")
        else:
            names.append("R")
    return ",".join(names)


class _Collectives:
    """Counts the collectives hp-dtensor issues inside a ``with`` block."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def __enter__(self) -> _Collectives:
        self._observing = collectives.observe_collectives(self._record)
        self._observing.__enter__()
        return self

    def _record(self, record: collectives.CollectiveRecord) -> None:
        self.kinds.append(record.kind)

    def __exit__(self, *exc: object) -> None:
        self._observing.__exit__(None, None, None)


# -- leaf gradients carry the leaf's layout --------------------------------------------------
def _leaf_gradients(world_size: int) -> list[str]:
    failures: list[str] = []
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    x_full = torch.randint(-4, 5, (6, 3), generator=g).float()
    w_full = torch.randint(-4, 5, (3, 2), generator=g).float()

    # An explicit Replicate seed, so the counts below are the gradient's own collectives.
    seed = DTensor.from_local(torch.ones(()), mesh, [Replicate()])

    # 1. a Replicate weight times a Shard(0) activation: the gradient stays Partial, as
    # torch leaves it (no collective in the backward); its sum over the ranks is the oracle's
    w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    x = distribute_tensor(x_full, mesh, [Shard(0)])
    loss = torch.mm(x, w).sum()
    with _Collectives() as comms:
        torch.autograd.backward(loss, seed)
    w_oracle = w_full.clone().requires_grad_()
    torch.autograd.backward(torch.mm(x_full, w_oracle).sum())
    assert w_oracle.grad is not None
    left = (Partial(),) if world_size > 1 else (Replicate(),)  # one rank: nothing to sum
    if not isinstance(w.grad, DTensor) or w.grad.placements != left:
        failures.append(
            f"replicated weight: .grad is {type(w.grad).__name__} {getattr(w.grad, 'placements', None)}"
        )
    elif not torch.equal(w.grad.full_tensor(), w_oracle.grad):
        failures.append(
            f"replicated weight: grad {w.grad.full_tensor().tolist()} != {w_oracle.grad.tolist()}"
        )
    if comms.kinds:
        failures.append(f"replicated weight: backward collectives {comms.kinds}, expected none")

    # 2. a Shard(0) weight whose gradient arrives Replicate ends Shard(0), by a free slice
    v = distribute_tensor(x_full, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    loss = (v * 3).sum()
    with _Collectives() as comms:
        torch.autograd.backward(loss, seed)
    expected = oracle_shard(torch.full_like(x_full, 3.0), (world_size,), (rank,), (Shard(0),))
    if not isinstance(v.grad, DTensor) or v.grad.placements != (Shard(0),):
        failures.append(f"sharded weight: .grad placements {getattr(v.grad, 'placements', None)}")
    elif not torch.equal(v.grad.to_local(), expected):
        failures.append(f"sharded weight: grad {v.grad.to_local().tolist()} != {expected.tolist()}")
    if comms.kinds:
        failures.append(f"sharded weight: backward collectives {comms.kinds}, expected none")

    # 3. a Partial gradient into a Shard(1) leaf is reduce-scattered
    u = distribute_tensor(x_full, mesh, [Shard(1)]).requires_grad_()
    contributions = [torch.full((6, 3), float(r + 1)) for r in range(world_size)]
    partial = DTensor.from_local(contributions[rank], mesh, [Partial()])
    with _Collectives() as comms:
        torch.autograd.backward(u, partial)
    total = torch.stack(contributions).sum(0)
    expected = oracle_shard(total, (world_size,), (rank,), (Shard(1),))
    if not isinstance(u.grad, DTensor) or u.grad.placements != (Shard(1),):
        failures.append(f"partial into Shard(1): placements {getattr(u.grad, 'placements', None)}")
    elif not torch.equal(u.grad.to_local(), expected):
        failures.append(
            f"partial into Shard(1): {u.grad.to_local().tolist()} != {expected.tolist()}"
        )
    if world_size > 1 and comms.kinds != ["reduce_scatter"]:
        failures.append(
            f"partial into Shard(1): collectives {comms.kinds}, expected one reduce_scatter"
        )

    # 4. the hook is registered once, and costs nothing when the layout already matches
    t = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    t.requires_grad_().requires_grad_(True)
    matching = DTensor.from_local(
        torch.ones(t.to_local().shape), mesh, [Shard(0)], shape=(6, 3), stride=(3, 1)
    )
    with _Collectives() as comms:
        torch.autograd.backward(t, matching)
        torch.autograd.backward(t, matching)  # accumulates
    t_grad = t.grad
    if (
        comms.kinds
        or not isinstance(t_grad, DTensor)
        or not torch.equal(t_grad.to_local(), 2 * matching.to_local())
    ):
        failures.append(f"matching layout: collectives {comms.kinds}, grad {t.grad}")
    p = distribute_tensor(w_full, mesh, [Shard(1)]).requires_grad_().requires_grad_()
    with _Collectives() as comms:  # a Partial gradient into a Shard leaf: one reduce-scatter
        torch.autograd.backward(p, DTensor.from_local(torch.ones(3, 2), mesh, [Partial()]))
    if comms.kinds != (["reduce_scatter"] if world_size > 1 else []):
        failures.append(f"requires_grad_ twice: backward collectives {comms.kinds} (hook twice?)")

    # 5. nn.Parameter(dt) keeps the hook; it survives load_state_dict and optimizer steps,
    # and the step reduces the Partial gradient (once, in place of .grad) before reading it
    expected_reduce = ["all_reduce"] if world_size > 1 else []
    linear = torch.nn.Linear(3, 2, bias=False)
    linear.weight = torch.nn.Parameter(
        distribute_tensor(w_full.t().contiguous(), mesh, [Replicate()])
    )
    linear.load_state_dict({"weight": w_full.t() * 2})
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.5)
    oracle = torch.nn.Linear(3, 2, bias=False)
    oracle.weight = torch.nn.Parameter(w_full.t() * 2)
    oracle_optimizer = torch.optim.SGD(oracle.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        oracle_optimizer.zero_grad()
        torch.autograd.backward(linear(x).sum())
        torch.autograd.backward(oracle(x_full).sum())
        grad = linear.weight.grad
        if not isinstance(grad, DTensor) or grad.placements != left:
            failures.append(f"nn.Parameter: grad placements {getattr(grad, 'placements', None)}")
            break
        with _Collectives() as comms:  # the step reduces the Partial gradient once, in place
            optimizer.step()
        oracle_optimizer.step()
        grad = linear.weight.grad
        if comms.kinds != expected_reduce or getattr(grad, "placements", None) != (Replicate(),):
            failures.append(f"nn.Parameter: step collectives {comms.kinds}, grad {grad}")
    weight = linear.weight
    assert isinstance(weight, DTensor)
    if not torch.equal(weight.full_tensor(), oracle.weight.detach()):
        failures.append("nn.Parameter: two SGD steps differ from the single-process oracle")
    return failures


@world_sizes(1, 2, 4)
def test_leaf_gradients_carry_the_leaf_layout(world_size: int) -> None:
    """Replicate weight x Shard activation -> Partial .grad (as torch) summing to the oracle; and friends."""
    results = run_on_ranks(_leaf_gradients, world_size, world_size, timeout_s=180)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


# -- gradient placements and values match torch DTensor ------------------------------------------
def _api(torch_side: bool) -> Any:
    """A namespace of the DTensor API of either library."""
    if torch_side:
        return tdt
    import hyper_parallel.dtensor as hp

    return hp


def _capture(dt: Any, seen: list[str]) -> None:
    dt.register_hook(lambda grad: seen.append(short(grad.placements)))


def _scenario_redistribute_grad_partial(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """S0 -> R, whose gradient is declared Partial: torch reduce-scatters it back to S0."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Shard(0)])
    _capture(x, seen)
    y = x.redistribute(mesh, [api.Replicate()])
    out = y.to_local(grad_placements=[api.Partial()])
    torch.autograd.backward((out * (dist.get_rank() + 1)).sum())
    return seen


def _scenario_partial_to_replicate(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """P -> R: the gradient of a Partial input is Replicate."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Partial()])
    _capture(x, seen)
    torch.autograd.backward((x.redistribute(mesh, [api.Replicate()]).to_local() * 2).sum())
    return seen


def _scenario_replicate_to_shard(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """R -> S1 -> full_tensor: the gradient of the Replicate input is all-gathered to R."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Replicate()])
    _capture(x, seen)
    y = x.redistribute(mesh, [api.Shard(1)])
    _capture(y, seen)
    torch.autograd.backward((y.full_tensor() ** 2).sum())
    return seen


def _scenario_to_local_grad_placements(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """to_local(grad_placements=[Partial()]) of a Replicate tensor: from_local all-reduces."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Replicate()])
    _capture(x, seen)
    out = x.to_local(grad_placements=[api.Partial()])
    torch.autograd.backward((out * (dist.get_rank() + 1)).sum())
    return seen


def _scenario_full_tensor_grad_placements(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """S0 -> full_tensor(grad_placements=[Partial()]): the gradient is reduce-scattered."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Shard(0)])
    _capture(x, seen)
    out = x.full_tensor(grad_placements=[api.Partial()])
    torch.autograd.backward((out * (dist.get_rank() + 1)).sum())
    return seen


def _scenario_shard_to_shard(api: Any, mesh: Any, local: torch.Tensor) -> list[str]:
    """S0 -> S1 (all-to-all); gradient S1 -> S0."""
    seen: list[str] = []
    x = api.DTensor.from_local(local, mesh, [api.Shard(0)])
    _capture(x, seen)
    y = x.redistribute(mesh, [api.Shard(1)])
    torch.autograd.backward((y.to_local() * (dist.get_rank() + 2)).sum())
    return seen


SCENARIOS = [
    _scenario_redistribute_grad_partial,
    _scenario_partial_to_replicate,
    _scenario_replicate_to_shard,
    _scenario_to_local_grad_placements,
    _scenario_full_tensor_grad_placements,
    _scenario_shard_to_shard,
]


def _autograd_like_torch(world_size: int) -> list[str]:
    failures: list[str] = []
    ours_mesh = init_device_mesh("cpu", (world_size,))
    torch_mesh = torch_init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(dist.get_rank())
    for scenario in SCENARIOS:
        local = torch.randint(-4, 5, (2, 2 * world_size), generator=g).float()
        results = []
        for torch_side, mesh in ((False, ours_mesh), (True, torch_mesh)):
            leaf = local.clone().requires_grad_()
            seen = scenario(_api(torch_side), mesh, leaf)
            results.append((seen, leaf.grad))
        (ours_seen, ours_grad), (torch_seen, torch_grad) = results
        name = scenario.__name__
        if ours_seen != torch_seen:
            failures.append(f"{name}: gradient placements {ours_seen}, torch DTensor {torch_seen}")
        if ours_grad is None or torch_grad is None or not torch.equal(ours_grad, torch_grad):
            failures.append(f"{name}: local gradient {ours_grad} != torch DTensor's {torch_grad}")
    return failures


@world_sizes(2, 4)
def test_gradient_placements_and_values_match_torch_dtensor(world_size: int) -> None:
    results = run_on_ranks(_autograd_like_torch, world_size, world_size, timeout_s=180)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: " + "\n".join(failures)

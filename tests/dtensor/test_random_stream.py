"""Stream mode of DTensor random ops: one device's draws, no collective after a mesh's first op.

``set_random_sync("stream")``: the first random op on each mesh syncs an agreed stream;
every later op draws from it with no collective, whatever each rank's generator did
(a per-rank ``torch.manual_seed``, rank 0 alone drawing plain numbers), and
``torch.utils.checkpoint`` replays dropout exactly.

Everything runs in one launch of 4 ranks on a ``(dp, tp) = (2, 2)`` mesh, one script in
each process: init on the tp, dp and 2-D meshes interleaved; a checkpointed block of two
dropouts; dropouts of a ``Replicate()`` tensor around per-rank events; the checkpointed
block again under per-rank seeds; dp groups drawing different numbers of ops on their tp
meshes (pipeline stages, say), then a mesh over all four ranks. Oracles: the same script on full tensors in one process
(the per-rank events left out: stream mode ignores them), bitwise; replicas equal across
ranks; ``CommDebugMode`` counts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import TEST_DEVICE, run_on_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import hyper_parallel.dtensor as hp

SEED = 1234
P_DROP = 0.4
VARIANTS = ("no checkpoint", "checkpoint", "reentrant checkpoint")

# (mesh, placements, init) in the order the script draws them: each mesh used, then reused
_INITS: tuple[tuple[str, tuple[str, ...], Callable[[torch.Tensor], object]], ...] = (
    ("tp", ("S0",), nn.init.normal_),
    ("dp", ("S1",), nn.init.uniform_),
    ("2d", ("S0", "R"), nn.init.kaiming_uniform_),
    ("tp", ("R",), nn.init.normal_),
    ("2d", ("R", "S1"), nn.init.xavier_normal_),
    ("dp", ("R",), nn.init.trunc_normal_),
)


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two dropouts, the second on a value that depends on the first's mask."""
    h = F.dropout(x * w, p=P_DROP, training=True)
    return F.dropout(torch.tanh(h), p=P_DROP, training=True) * w


@contextmanager
def _counted() -> Iterator[dict[str, int]]:
    """Collectives of the block by kind (filled on exit)."""
    counts: dict[str, int] = {}
    with hp.CommDebugMode() as mode:
        yield counts
    counts.update({kind: n for kind, n in mode.counts().items() if n})


class _Ranks:
    """The script on DTensors over this rank's meshes, with the per-rank events."""

    def __init__(self) -> None:
        self.mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        self.world = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        self.rank = torch.distributed.get_rank()
        self.events = True

    def put(self, tensor: torch.Tensor, mesh: str, placements: tuple[str, ...]) -> torch.Tensor:
        named = {"2d": self.mesh, "world": self.world}
        on = named[mesh] if mesh in named else self.mesh[mesh]
        parsed = [hp.Replicate() if p == "R" else hp.Shard(int(p[1:])) for p in placements]
        return hp.distribute_tensor(tensor, on, parsed)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        assert isinstance(tensor, hp.DTensor)
        return tensor.full_tensor().detach().clone()

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        assert isinstance(tensor, hp.DTensor)
        return tensor.to_local().detach().clone()

    def comm(self) -> AbstractContextManager[dict[str, int]]:
        return _counted()

    def checkpointed(self, variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if variant == "no checkpoint":
            return _block

        def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            reentrant = variant == "reentrant checkpoint"
            out: torch.Tensor = checkpoint(_block, x, w, use_reentrant=reentrant)
            return out

        return run


class _OneDevice(_Ranks):
    """The same script on full tensors in one process, no checkpointing, no per-rank events."""

    def __init__(self) -> None:
        self.rank = 0
        self.events = False

    def put(self, tensor: torch.Tensor, mesh: str, placements: tuple[str, ...]) -> torch.Tensor:
        return tensor.clone()

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    local = full

    def comm(self) -> AbstractContextManager[dict[str, int]]:
        return nullcontext({})

    def checkpointed(self, variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return _block


def _blocks(on: _Ranks, label: str, seed: Callable[[], None]) -> dict[str, Any]:
    """The block forward and backward in each variant; ``seed()`` runs before each."""
    out: dict[str, Any] = {}
    x = on.put(torch.linspace(-1.0, 1.0, 24).view(4, 6), "2d", ("R", "R"))
    w = on.put(torch.linspace(0.5, 1.5, 24).view(4, 6), "2d", ("R", "R")).requires_grad_()
    for variant in VARIANTS:
        w.grad = None
        seed()
        with on.comm() as comm:
            on.checkpointed(variant)(x, w).sum().backward()  # type: ignore[no-untyped-call]
        assert w.grad is not None
        out[f"{label}, {variant}"] = {"grad": on.full(w.grad), "comm": comm}
    return out


def _script(on: _Ranks) -> dict[str, Any]:
    rank, events = on.rank, on.events
    out: dict[str, Any] = {}
    torch.manual_seed(SEED)
    for i, (mesh, placements, init) in enumerate(_INITS):
        weight = on.put(torch.empty(8, 6), mesh, placements)
        with on.comm() as comm:
            init(weight)
        out[f"init {i}"] = {"value": on.full(weight), "comm": comm}
    out.update(_blocks(on, "same seeds", lambda: None))

    x = on.put(torch.ones(4, 8), "2d", ("R", "R"))
    fill = on.put(torch.empty(4, 8), "2d", ("R", "S1"))
    steps: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("steady", lambda: F.dropout(x, p=P_DROP, training=True)),
        ("rank 0 drew alone", lambda: F.dropout(x, p=P_DROP, training=True)),
        ("per-rank seeds, sharded uniform_", lambda: fill.uniform_()),
        ("per-rank seeds", lambda: F.dropout(x, p=P_DROP, training=True)),
        ("per-rank seeds, again", lambda: F.dropout(x, p=P_DROP, training=True)),
    ]
    for label, op in steps:
        if events and label == "rank 0 drew alone" and rank == 0:
            torch.rand(5)
        if events and label == "per-rank seeds, sharded uniform_":
            torch.manual_seed(100 + rank)
        with on.comm() as comm:
            value = op()
        out[label] = {"value": on.full(value), "local": on.local(value), "comm": comm}
    if events:
        out["plain draw after"] = torch.rand(3)  # the rank's own generator carries on

    def per_rank_seed() -> None:
        if events:
            torch.manual_seed(300 + rank)

    out.update(_blocks(on, "per-rank seeds", per_rank_seed))
    out.update(_stages(on))
    return out


def _stages(on: _Ranks) -> dict[str, Any]:
    """Stages with different histories on their own tp meshes, then a mesh all ranks share.

    dp rank 0's tp mesh draws three dropouts, dp rank 1's one; the shared mesh's first op
    syncs its first rank's stream (ranks that held another are warned), later ones do not.
    """
    out: dict[str, Any] = {}
    x = on.put(torch.ones(4, 8), "tp", ("R",))
    for _ in range(3 if on.rank // 2 == 0 else 1):
        F.dropout(x, p=P_DROP, training=True)
    shared = on.put(torch.ones(4, 8), "world", ("R",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for label in ("shared mesh, first op", "shared mesh, next op"):
            with on.comm() as comm:
                value = F.dropout(shared, p=P_DROP, training=True)
            out[label] = {"value": on.full(value), "local": on.local(value), "comm": comm}
    out["shared mesh warned"] = any(w.category is hp.RandomSeedWarning for w in caught)
    return out


def _on_four_ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    previous = hp.set_random_sync("stream")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _script(_Ranks())
    finally:
        restored = hp.set_random_sync(previous)
    result["modes"] = (previous, restored)
    result["warned"] = [str(w.message) for w in caught if w.category is hp.RandomSeedWarning]
    return result


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_on_four_ranks, 4, timeout_s=180.0)


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    previous = hp.set_random_sync("stream")  # plain tensors: the mode changes nothing
    try:
        return _script(_OneDevice())
    finally:
        hp.set_random_sync(previous)


def test_init_on_interleaved_meshes_is_one_devices_sequence(
    four_ranks: list[dict[str, Any]], one_device: dict[str, Any]
) -> None:
    # each mesh's first op syncs once (one broadcast per axis of size 2), reuse is free
    want_comm = [{"broadcast": 1}, {"broadcast": 1}, {"broadcast": 2}, {}, {}, {}]
    for rank, got in enumerate(four_ranks):
        for i in range(len(_INITS)):
            mine = got[f"init {i}"]
            assert torch.equal(mine["value"], one_device[f"init {i}"]["value"]), (rank, i)
            assert mine["comm"] == want_comm[i], (rank, i, mine["comm"])
        assert got["warned"] == [], (rank, got["warned"])  # equal seeds: nothing replaced


def test_dropout_after_first_op_issues_no_collective_whatever_ranks_draw(
    four_ranks: list[dict[str, Any]], one_device: dict[str, Any]
) -> None:
    labels = (
        "steady",
        "rank 0 drew alone",
        "per-rank seeds, sharded uniform_",
        "per-rank seeds",
        "per-rank seeds, again",
    )
    for rank, got in enumerate(four_ranks):
        for label in labels:
            mine = got[label]
            assert mine["comm"] == {}, (rank, label, mine["comm"])
            # the one-device continuation of the stream: the per-rank events are ignored
            assert torch.equal(mine["value"], one_device[label]["value"]), (rank, label)
            if "sharded" not in label:  # Replicate on both axes: every rank holds the whole
                assert torch.equal(mine["local"], four_ranks[0][label]["local"]), (rank, label)
    # consecutive dropouts differ (the stream advances)
    assert not torch.equal(one_device["per-rank seeds"]["value"], one_device["steady"]["value"])


def test_per_rank_seed_survives_forked_ops(four_ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(four_ranks):
        # the rank's own generator: its seed, then one tick per forked op (uniform_, 2 dropouts)
        torch.manual_seed(100 + rank)
        for _ in range(3):
            torch.empty(1).uniform_()
        assert torch.equal(got["plain draw after"], torch.rand(3)), rank
    draws = [got["plain draw after"] for got in four_ranks]
    assert all(not torch.equal(draws[0], other) for other in draws[1:])


def test_a_mesh_shared_after_different_histories_syncs_once(
    four_ranks: list[dict[str, Any]], one_device: dict[str, Any]
) -> None:
    for rank, got in enumerate(four_ranks):
        for label, want_comm in (
            ("shared mesh, first op", {"broadcast": 1}),
            ("shared mesh, next op", {}),
        ):
            mine = got[label]
            assert mine["comm"] == want_comm, (rank, label, mine["comm"])
            assert torch.equal(mine["local"], four_ranks[0][label]["local"]), (rank, label)
            # rank 0's stream (dp rank 0's history, which the one-device script follows)
            assert torch.equal(mine["value"], one_device[label]["value"]), (rank, label)
        assert got["shared mesh warned"] == (rank >= 2), rank  # dp rank 1 drew fewer ops


@pytest.mark.parametrize("label", ["same seeds", "per-rank seeds"])
def test_checkpointed_dropout_gradients_equal_the_uncheckpointed_block(
    four_ranks: list[dict[str, Any]], one_device: dict[str, Any], label: str
) -> None:
    for rank, got in enumerate(four_ranks):
        for variant in VARIANTS:
            key = f"{label}, {variant}"
            mine = got[key]
            # the oracle runs every variant without checkpointing, from the same stream
            assert torch.equal(mine["grad"], one_device[key]["grad"]), (rank, key)
            assert torch.equal(mine["grad"], four_ranks[0][key]["grad"]), (rank, key)
            assert mine["comm"] == {}, (rank, key, mine["comm"])
    grads = [one_device[f"{label}, {variant}"]["grad"] for variant in VARIANTS]
    assert not torch.equal(grads[0], grads[1])  # each call draws new masks


def test_set_random_sync_returns_the_previous_mode_and_restores(
    four_ranks: list[dict[str, Any]],
) -> None:
    for got in four_ranks:
        assert got["modes"] == ("check", "stream")
    previous = hp.set_random_sync("stream")
    try:
        assert previous == "check"
        assert hp.set_random_sync("stream") == "stream"
    finally:
        assert hp.set_random_sync(previous) == "stream"


def test_set_random_sync_rejects_an_unknown_mode_and_keeps_the_current_one() -> None:
    with pytest.raises(ValueError, match=r"expected one of \['check', 'stream'\], found 'steam'"):
        hp.set_random_sync("steam")  # type: ignore[arg-type]
    assert hp.set_random_sync("check") == "check"


def _forget_forks(budget_states: int) -> dict[str, Any]:
    """Per-rank seed on a 1-rank mesh: every dropout forks; room for ``budget_states`` states."""
    from hyper_parallel.dtensor import _seeds

    torch.set_num_threads(1)
    device = torch.device(TEST_DEVICE, 0) if TEST_DEVICE != "cpu" else torch.device("cpu")
    state_bytes = _seeds._generator_state(device).numel()  # 5 KB on CPU, 16 bytes on CUDA
    _seeds._REPLAY_BYTES = budget_states * state_bytes  # a small memory, same rule
    mesh = hp.init_device_mesh(TEST_DEVICE, (1,))
    x = hp.distribute_tensor(torch.ones(4, 4, device=device), mesh, [hp.Replicate()])
    w = hp.distribute_tensor(torch.ones(4, 4, device=device), mesh, [hp.Replicate()])
    w.requires_grad_()
    previous = hp.set_random_sync("stream")
    out: dict[str, Any] = {}
    try:
        F.dropout(x, p=P_DROP, training=True)  # the mesh's first op starts the stream
        torch.manual_seed(7)  # from here on the rank's generator is not the stream: ops fork

        def block() -> torch.Tensor:
            return F.dropout(x * w, p=P_DROP, training=True)

        for label, forks_before_backward in (("within memory", 0), ("forgotten", budget_states)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                w.grad = None
                kept = checkpoint(block, use_reentrant=False)  # its mask: drawn here, forked
                for _ in range(forks_before_backward):
                    F.dropout(x, p=P_DROP, training=True)
                kept.sum().backward()  # type: ignore[no-untyped-call]
                assert w.grad is not None
                out[label] = {
                    "forward": kept.to_local().detach().cpu(),
                    "grad": w.grad.to_local().cpu(),
                    "warned": [
                        str(c.message) for c in caught if c.category is hp.RandomSeedWarning
                    ],
                }
    finally:
        hp.set_random_sync(previous)
    return out


def test_a_recompute_beyond_the_memory_of_forked_ops_is_warned_about_once() -> None:
    """Also on CUDA (``bench/gpu_smoke.sh``): the fork, the tick and the replay on its generator."""
    (got,) = run_on_ranks(_forget_forks, 1, 3, timeout_s=120.0)
    within = got["within memory"]
    # the recomputed mask is the forward's: the gradient is the forward's output (x = w = 1)
    assert torch.equal(within["grad"], within["forward"])
    assert within["warned"] == []
    forgotten = got["forgotten"]
    (message,) = forgotten["warned"]  # once, when the first entry is dropped
    assert "activation-checkpoint recompute" in message and "remembers the last 3" in message

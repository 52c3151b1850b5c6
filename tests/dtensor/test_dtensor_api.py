"""The DTensor API a user relies on: construction, conversion, parameters, state_dict, errors.

Each test is one launch that runs many checks and returns failure messages; values
are compared with the single-process oracle (the full tensor sliced by torch.chunk).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from tests._harness import run_on_ranks, world_sizes
from tests.dtensor.test_redistribute import oracle_shard

from hyper_parallel.dtensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)


class _Checks:
    """Collects failure messages instead of stopping at the first one."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def equal(self, what: str, found: torch.Tensor, expected: torch.Tensor) -> None:
        if found.shape != expected.shape or not torch.equal(found, expected):
            self.failures.append(f"{what}: {found.tolist()} != {expected.tolist()}")

    def true(self, what: str, condition: bool) -> None:
        if not condition:
            self.failures.append(what)

    def raises(
        self, what: str, fn: Callable[[], object], error: type[BaseException], *fragments: str
    ) -> None:
        try:
            fn()
        except error as exc:
            missing = [f for f in fragments if f not in str(exc)]
            if missing:
                self.failures.append(f"{what}: message {str(exc)!r} lacks {missing}")
            return
        except Exception as exc:
            self.failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
            return
        self.failures.append(f"{what}: did not raise {error.__name__}")


def as_dt(value: object) -> DTensor:
    """``value``, which must be a DTensor (raises AssertionError naming its type otherwise)."""
    assert isinstance(value, DTensor), f"expected a DTensor, found {type(value).__name__}"
    return value


def _full(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).float()


# -- construction --------------------------------------------------------------------------
def _construction(world_size: int) -> list[str]:
    c = _Checks()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    full = _full((5, 3))

    # from_local: even shards infer the global shape
    even = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    c.true(f"from_local even: shape {tuple(even.shape)}", tuple(even.shape) == (2 * world_size, 3))
    c.true("placements is a tuple", even.placements == (Shard(0),) and even.device_mesh == mesh)

    # uneven shards with shape= and stride=, and with run_check inferring the shape
    local = oracle_shard(full, (world_size,), (rank,), (Shard(0),))
    uneven = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
    c.true(
        f"shape= {tuple(uneven.shape)}", tuple(uneven.shape) == (5, 3) and uneven.stride() == (3, 1)
    )
    c.equal("uneven full_tensor", uneven.full_tensor(), full)
    column_major = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3), stride=(1, 5))
    c.true(f"stride= {column_major.stride()}", column_major.stride() == (1, 5))
    checked = DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    c.true(f"run_check infers {tuple(checked.shape)}", tuple(checked.shape) == (5, 3))
    c.equal("run_check full_tensor", checked.full_tensor(), full)
    # run_check makes Replicate values agree: the first rank of the axis wins
    mine = torch.full((2,), float(rank))
    agreed = DTensor.from_local(mine, mesh, [Replicate()], run_check=True)
    c.equal("run_check broadcasts Replicate", agreed.to_local(), torch.zeros(2))
    leaf = mine.clone().requires_grad_()
    torch.autograd.backward(
        DTensor.from_local(leaf, mesh, [Replicate()], run_check=True).to_local().sum()
    )
    c.equal(
        "run_check keeps the gradient path",
        torch.zeros(2) if leaf.grad is None else leaf.grad,
        torch.ones(2),
    )
    c.equal("to_local is the shard", uneven.to_local(), local)

    # distribute_tensor: rank k's data wins for src_data_rank=k; None slices locally
    own = full + 100 * rank
    for src in sorted({0, world_size - 1}):
        layouts_1d: list[list[Placement]] = [[Shard(0)], [Shard(1)], [Replicate()]]
        for placements in layouts_1d:
            dt = distribute_tensor(own, mesh, placements, src_data_rank=src)
            expected = oracle_shard(full + 100 * src, (world_size,), (rank,), placements)
            c.equal(f"distribute_tensor {placements} src {src}", dt.to_local(), expected)
            c.equal(
                f"distribute_tensor {placements} src {src} full", dt.full_tensor(), full + 100 * src
            )
    sliced = distribute_tensor(own, mesh, [Shard(1)], src_data_rank=None)
    c.equal(
        "src_data_rank=None",
        sliced.to_local(),
        oracle_shard(own, (world_size,), (rank,), [Shard(1)]),
    )
    c.true(
        "distribute_tensor keeps requires_grad",
        distribute_tensor(full.requires_grad_(), mesh).is_leaf,
    )
    full.requires_grad_(False)
    distribute_tensor(own, mesh, src_data_rank=None).to_local().add_(1)
    c.equal("the input is not aliased", own, full + 100 * rank)

    if world_size == 4:
        mesh_2d = init_device_mesh("cpu", (2, 2))
        coordinate = mesh_2d.get_coordinate()
        assert coordinate is not None
        big = _full((5, 7), seed=1)
        mine_2d = big + 100 * rank
        layouts: list[list[Placement]] = [
            [Shard(0), Shard(1)],
            [Replicate(), Shard(0)],
            [Shard(0), Shard(0)],
            [Shard(1), Replicate()],
        ]
        for src in (0, 1):  # a group rank on each mesh axis: the data of coordinate (src, src)
            owner = int(mesh_2d.mesh[src, src])
            for placements in layouts:
                dt = distribute_tensor(mine_2d, mesh_2d, placements, src_data_rank=src)
                expected = oracle_shard(big + 100 * owner, (2, 2), coordinate, placements)
                c.equal(f"2-D distribute_tensor {placements} src {src}", dt.to_local(), expected)
        nested = distribute_tensor(mine_2d, mesh_2d, [Shard(0), Shard(0)], src_data_rank=None)
        c.equal(
            "2-D None",
            nested.to_local(),
            oracle_shard(mine_2d, (2, 2), coordinate, [Shard(0), Shard(0)]),
        )
        uneven_2d = DTensor.from_local(
            oracle_shard(big, (2, 2), coordinate, [Shard(0), Shard(1)]),
            mesh_2d,
            [Shard(0), Shard(1)],
            run_check=True,
        )
        c.true(f"2-D run_check shape {tuple(uneven_2d.shape)}", tuple(uneven_2d.shape) == (5, 7))
    return c.failures


@world_sizes(1, 2, 4)
def test_from_local_to_local_full_tensor_and_distribute_tensor(world_size: int) -> None:
    results = run_on_ranks(_construction, world_size, world_size, timeout_s=180)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


# -- tensor behaviour, parameters, state_dict --------------------------------------------------
def _tensor_behaviour(world_size: int) -> list[str]:
    c = _Checks()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    full = _full((5, 3))
    dt = distribute_tensor(full, mesh, [Shard(0)])
    local = oracle_shard(full, (world_size,), (rank,), [Shard(0)])

    detached = dt.detach()
    c.true(
        "detach keeps the layout",
        isinstance(detached, DTensor) and detached.placements == (Shard(0),),
    )
    cloned = as_dt(dt.clone())
    cloned.to_local().add_(1)
    c.equal("clone is a copy", dt.to_local(), local)
    c.true("clone is a DTensor", isinstance(cloned, DTensor) and cloned.placements == (Shard(0),))
    for name, converted in (
        ("to(float64)", as_dt(dt.to(torch.float64))),
        ("double()", as_dt(dt.double())),
    ):
        c.true(f"{name} dtype {converted.dtype}", converted.dtype == torch.float64)
        c.true(
            f"{name} stays a DTensor",
            isinstance(converted, DTensor) and converted.placements == (Shard(0),),
        )
        c.equal(f"{name} values", converted.full_tensor(), full.double())
    grad_dt = dt.detach().requires_grad_()
    c.true("requires_grad_ returns the leaf", grad_dt.requires_grad and grad_dt.is_leaf)

    # nn.Parameter(dt) stays a DTensor that optimizers update like the full tensor
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    c.true(
        f"Parameter type {type(param).__name__}",
        isinstance(param, DTensor) and isinstance(param, torch.nn.Parameter),
    )
    c.true("Parameter requires grad", param.requires_grad and param.is_leaf)
    oracle = torch.nn.Parameter(full.clone())
    optimizer = torch.optim.AdamW([param], lr=0.1)
    oracle_optimizer = torch.optim.AdamW([oracle], lr=0.1)
    for step in range(2):
        target = _full((5, 3), seed=10 + step)
        torch.autograd.backward(
            ((param - distribute_tensor(target, mesh, [Replicate()])) ** 2).sum()
        )
        torch.autograd.backward(((oracle - target) ** 2).sum())
        optimizer.step()
        oracle_optimizer.step()
        optimizer.zero_grad()
        oracle_optimizer.zero_grad()
    c.true(
        "AdamW step keeps the layout",
        isinstance(param, DTensor) and param.placements == (Shard(0),),
    )
    found = as_dt(param.detach()).full_tensor()
    if not torch.allclose(found, oracle.detach(), atol=1e-6):
        c.failures.append(f"AdamW on a DTensor parameter: {found.tolist()} != {oracle.tolist()}")

    # state_dict round trip, and loading a state_dict of plain full tensors
    module = torch.nn.Linear(3, 5)
    module.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    module.bias = torch.nn.Parameter(distribute_tensor(full[:, 0].clone(), mesh, [Replicate()]))
    state = module.state_dict()
    c.true("state_dict holds DTensors", all(isinstance(v, DTensor) for v in state.values()))
    other = torch.nn.Linear(3, 5)
    other.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]))
    other.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(5), mesh, [Replicate()]))
    other.load_state_dict(state)
    c.equal("load_state_dict(DTensors)", as_dt(other.weight).full_tensor(), full)
    plain = {"weight": full * 2, "bias": full[:, 0] * 2}
    other.load_state_dict(plain)
    c.equal("load_state_dict(full tensors) weight", as_dt(other.weight).full_tensor(), full * 2)
    c.equal("load_state_dict(full tensors) bias", as_dt(other.bias).full_tensor(), full[:, 0] * 2)
    c.true("load keeps the layout", as_dt(other.weight).placements == (Shard(0),))
    return c.failures


@world_sizes(2, 4)
def test_detach_clone_dtype_parameter_optimizer_state_dict(world_size: int) -> None:
    results = run_on_ranks(_tensor_behaviour, world_size, world_size, timeout_s=180)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


# -- bad inputs ---------------------------------------------------------------------------
def _bad_inputs() -> list[str]:
    c = _Checks()
    mesh = init_device_mesh("cpu", (2,))
    named = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))
    full = torch.zeros(4, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    c.raises(
        "from_local wrong placement count",
        lambda: DTensor.from_local(full, mesh, [Shard(0), Replicate()]),
        ValueError,
        "DTensor.from_local",
        "expected 1 placement(s)",
        "found 2",
    )
    c.raises(
        "distribute_tensor wrong placement count",
        lambda: distribute_tensor(full, mesh, []),
        ValueError,
        "distribute_tensor",
        "expected 1 placement(s)",
        "found 0",
    )
    c.raises(
        "redistribute wrong placement count",
        lambda: dt.redistribute(mesh, [Replicate(), Replicate()]),
        ValueError,
        "DTensor.redistribute",
        "expected 1 placement(s)",
    )
    c.raises(
        "bare placement",
        lambda: distribute_tensor(full, mesh, Shard(0)),  # type: ignore[arg-type]
        TypeError,
        "bare Shard(dim=0)",
        "write (Shard(dim=0),)",
    )
    c.raises(
        "Shard dim out of range",
        lambda: distribute_tensor(full, mesh, [Shard(2)]),
        ValueError,
        "mesh axis 0",
        "Shard(dim=2) is out of range",
        "2 dim(s)",
    )
    c.raises(
        "negative Shard dim out of range",
        lambda: dt.redistribute(mesh, [Shard(-3)]),
        ValueError,
        "Shard(dim=-3) is out of range",
    )
    c.raises(
        "redistribute to Partial",
        lambda: dt.redistribute(mesh, [Replicate()]).redistribute(mesh, [Partial()]),
        RuntimeError,  # torch's error class (ours is also a ValueError)
        "mesh axis 0",
        "cannot redistribute Replicate() to Partial(reduce_op='sum')",
        "Use Replicate() or Shard(dim)",
    )
    c.raises(
        "redistribute without placements",
        lambda: dt.redistribute(mesh),
        ValueError,
        "placements are required",
    )
    c.raises(
        "from_local shape mismatch",
        lambda: DTensor.from_local(
            torch.zeros(3, 3), mesh, [Shard(0)], shape=(8, 3), stride=(3, 1)
        ),
        ValueError,
        "global shape (8, 3)",
        "must hold a shard of shape (4, 3)",
        "found (3, 3)",
    )
    c.raises(
        "from_local shape with the wrong rank",
        lambda: DTensor.from_local(full, mesh, [Shard(0)], shape=(8,), stride=(1,)),
        ValueError,
        "shape (8,) has 1 dim(s), the local tensor has 2",
    )
    c.raises(
        "from_local of a DTensor",
        lambda: DTensor.from_local(dt, mesh, [Shard(0)]),
        TypeError,
        "expected a plain torch.Tensor, found DTensor",
    )
    c.raises(
        "distribute_tensor of a DTensor",
        lambda: distribute_tensor(dt, mesh, [Shard(0)]),
        TypeError,
        "already a DTensor",
        ".redistribute()",
    )
    c.raises(
        "src_data_rank not a group rank",
        lambda: distribute_tensor(full, mesh, [Shard(0)], src_data_rank=5),
        ValueError,
        "src_data_rank=5 is a group rank on each mesh axis",
        "0 <= src_data_rank < 2",
    )
    c.raises(
        "redistribute to a different mesh",
        lambda: dt.redistribute(named, [Replicate()]),
        ValueError,
        "moving between meshes is not supported",
        "mesh_dim_names=('tp',)",
    )
    other = distribute_tensor(full, named, [Shard(0)])
    c.raises(
        "an op on DTensors of different meshes",
        lambda: dt + other,
        ValueError,
        "different meshes",
    )
    # run_check: one rank's bad shard fails every rank instead of hanging the others
    bad_local = torch.zeros(2 + dist.get_rank(), 3)
    c.raises(
        "run_check with a shard that torch.chunk cannot produce",
        lambda: DTensor.from_local(
            bad_local, mesh, [Shard(0)], shape=(4, 3), stride=(3, 1), run_check=True
        ),
        ValueError,
        "DTensor.from_local",
    )
    return c.failures


def test_bad_inputs_raise_clear_errors() -> None:
    results = run_on_ranks(_bad_inputs, 2, timeout_s=120)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)

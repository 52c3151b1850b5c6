"""torch's DTensor API surface a user relies on, checked against torch on the same inputs.

Ported from torch's ``test_dtensor.py`` / ``test_dtensor_ops.py`` / ``test_init.py``:
foreach ops over DTensors on different meshes, ``redistribute(forward_dtype=,
backward_dtype=)``, ``DeviceMesh`` as a context manager, the factories ``ones``,
``zeros``, ``full``, ``empty``, ``rand``, ``randn``, ``from_local(shape=, stride=)``,
``to_local()`` under ``no_grad``, and the error classes of misuse (a RuntimeError
where torch raises one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tests._harness import run_on_ranks, world_sizes
from tests._tolerance import assert_close_to_scale
from tests.dtensor._torch_twin import Side, full, layout, sides

import hyper_parallel.dtensor as hp


def _foreach_two_meshes(side: Side) -> dict[str, Any]:
    """An optimizer-like foreach step over tensors on mesh['dp'] and mesh['tp']."""
    gen = torch.Generator().manual_seed(3)
    a_full, b_full = torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    dp, tp = side.mesh["dp"], side.mesh["tp"]
    a = side.module.distribute_tensor(a_full.clone(), tp, [side.Shard(0)])
    b = side.module.distribute_tensor(b_full.clone(), dp, [side.Replicate()])
    with side.comm() as counts:
        torch._foreach_mul_([a, b], 2.0)
        summed = torch._foreach_add([a, b], [a, b])
        norms = torch._foreach_norm([a, b])
    return {
        "a": full(a),
        "b": full(b),
        "layouts": layout([a, b, *summed, *norms]),
        "meshes": [t.device_mesh.mesh.tolist() for t in (*summed, *norms)],  # type: ignore[attr-defined]
        "summed": [full(t) for t in summed],
        "norms": [full(t) for t in norms],
        "comm": counts,
    }


def _redistribute_dtypes(side: Side) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    x_full = torch.randn(4, 6, generator=gen)
    x = side.distribute(x_full, [side.Shard(0)]).requires_grad_()
    with side.comm() as forward:
        y = x.redistribute(
            side.mesh,
            [side.Replicate()],
            forward_dtype=torch.bfloat16,
            backward_dtype=torch.float64,
        )
    with side.comm() as backward:
        (y.float() * 3).sum().backward()
    assert x.grad is not None
    return {
        "y dtype": y.dtype,
        "y local dtype": y.to_local().dtype,
        "y": full(y).float(),
        "grad dtype": x.grad.dtype,
        "grad": full(x.grad),
        "layouts": layout([y, x.grad]),
        "forward": forward,
        "backward": backward,
    }


def _context_and_factories(side: Side) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = side.mesh
    out: dict[str, Any] = {}
    with mesh:
        local = torch.full((2, 3), float(rank))
        out["from_local"] = layout(side.DTensor.from_local(local, placements=[side.Shard(0)]))
        dt = side.module.distribute_tensor(
            torch.arange(12.0).reshape(4, 3), placements=[side.Shard(1)]
        )
        out["distribute"] = (layout(dt), dt.to_local())
        ones = side.module.ones(5, 3, placements=[side.Shard(0)])
    out["ones"] = (layout(ones), ones.to_local(), tuple(ones.shape))
    factories: dict[str, Callable[..., Any]] = {
        "zeros": lambda **k: side.module.zeros(4, 6, **k),
        "full": lambda **k: side.module.full((4, 6), 1.5, **k),
        "empty": lambda **k: side.module.empty(4, 6, **k),
        "ones_list_size": lambda **k: side.module.ones([3, 5], **k),
    }
    for name, make in factories.items():
        for placements in ([side.Shard(0)], [side.Shard(1)], [side.Replicate()]):
            dt = make(device_mesh=mesh, placements=placements, requires_grad=True)
            key = f"{name} {layout(dt)}"
            value = dt.to_local() if name != "empty" else None
            out[key] = (
                tuple(dt.shape),
                tuple(dt.to_local().shape),
                dt.dtype,
                dt.requires_grad,
                value,
            )
    # from_local(shape=, stride=): the given global stride is the DTensor's
    n = mesh.size()
    column_major = side.from_local(
        torch.zeros(2, 3), [side.Shard(0)], shape=(2 * n, 3), stride=(1, 2 * n)
    )
    out["stride"] = (tuple(column_major.shape), column_major.stride())
    # to_local() under no_grad is the shard itself, no autograd node
    x = side.distribute(torch.ones(4, 2), [side.Shard(0)]).requires_grad_()
    with torch.no_grad():
        out["no_grad to_local is the shard"] = x.to_local() is x._local_tensor
    out["grad to_local has a node"] = x.to_local().grad_fn is not None
    return out


def _random_factories() -> dict[str, Any]:
    """rand/randn: each rank's slice of what one device draws after the same seed."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    failures = []
    for name, make, oracle in (
        ("rand", hp.rand, torch.rand),
        ("randn", hp.randn, torch.randn),
    ):
        for placements in ([hp.Shard(0)], [hp.Shard(1)], [hp.Replicate()]):
            torch.manual_seed(7)
            dt = make(5, 33, device_mesh=mesh, placements=placements)
            torch.manual_seed(7)
            want = oracle(5, 33)
            if not torch.equal(dt.full_tensor(), want) or dt.placements != tuple(placements):
                failures.append(f"{name} {placements}")
    return {"failures": failures}


def _errors(side: Side) -> dict[str, tuple[str, bool, bool] | None]:
    rank = dist.get_rank()
    x = side.distribute(torch.ones(4, 4), [side.Shard(0)])
    r = side.distribute(torch.ones(4, 4), [side.Replicate()])
    probes: dict[str, Callable[[], object]] = {
        "redistribute without placements": lambda: x.redistribute(side.mesh),
        "redistribute Replicate -> Partial": lambda: r.redistribute(side.mesh, [side.Partial()]),
        "from_local stride without shape": lambda: side.from_local(
            torch.ones(2, 2), [side.Shard(0)], stride=(2, 1)
        ),
        "plain tensor mixed with a DTensor": lambda: x + torch.ones(4, 4),
        "run_check shape mismatch": lambda: side.from_local(
            torch.ones(2, 2 + rank), [side.Shard(0)], run_check=True
        ),
        "Shard dim out of range": lambda: side.distribute(torch.ones(4), [side.Shard(3)]),
    }
    out: dict[str, tuple[str, bool, bool] | None] = {}
    for name, probe in probes.items():
        try:
            probe()
            out[name] = None
        except Exception as exc:
            out[name] = (
                type(exc).__name__,
                isinstance(exc, RuntimeError),
                isinstance(exc, ValueError),
            )
    return out


def _on_both(
    scenario: Callable[[Side], dict[str, Any]], mesh_shape: tuple[int, ...], names: Any
) -> Any:
    ours, theirs = sides(mesh_shape, names)
    return scenario(ours), scenario(theirs)


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for key, mine in ours.items():
        _assert_value(key, mine, theirs[key])


def _assert_value(key: str, mine: Any, theirs: Any) -> None:
    if isinstance(mine, torch.Tensor):
        assert isinstance(theirs, torch.Tensor)
        assert mine.dtype == theirs.dtype, (key, mine.dtype, theirs.dtype)
        assert_close_to_scale(
            mine.double(),
            theirs.double(),
            rel=1e-2 if mine.dtype == torch.bfloat16 else 1e-5,
            what=key,
        )
    elif (
        isinstance(mine, (list, tuple)) and mine and any(isinstance(m, torch.Tensor) for m in mine)
    ):
        for m, t in zip(mine, theirs, strict=True):
            _assert_value(key, m, t)
    else:
        assert mine == theirs, (key, mine, theirs)


def test_foreach_ops_over_dtensors_on_different_meshes_like_torch() -> None:
    for ours, theirs in run_on_ranks(_on_both, 4, _foreach_two_meshes, (2, 2), ("dp", "tp")):
        # README: the norm of a sharded tensor is reduced in the kernel (one all-reduce per
        # mesh axis for the whole list) and comes out Replicate; torch returns a lazy Partial.
        assert theirs["layouts"][4] == (("P", "sum"),)
        theirs["layouts"][4] = (("R",),)
        theirs["comm"]["all_reduce"] = theirs["comm"].get("all_reduce", 0) + 1
        _assert_same(ours, theirs)


@world_sizes(2, 4)
def test_redistribute_forward_and_backward_dtype_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(
        _on_both, world_size, _redistribute_dtypes, (world_size,), None
    ):
        _assert_same(ours, theirs)
        assert ours["y dtype"] == torch.bfloat16 and ours["grad dtype"] == torch.float32


@world_sizes(2, 4)
def test_device_mesh_context_factories_strides_and_to_local_like_torch(world_size: int) -> None:
    for ours, theirs in run_on_ranks(
        _on_both, world_size, _context_and_factories, (world_size,), None
    ):
        _assert_same(ours, theirs)
        assert ours["no_grad to_local is the shard"] and ours["stride"][1] == (1, 2 * world_size)


@world_sizes(2, 4)
def test_rand_and_randn_factories_equal_one_device_draws(world_size: int) -> None:
    for result in run_on_ranks(_random_factories, world_size):
        assert result["failures"] == []


@world_sizes(2)
def test_misuse_raises_runtime_error_where_torch_does(world_size: int) -> None:
    for ours, theirs in run_on_ranks(_on_both, world_size, _errors, (world_size,), None):
        for name, torch_error in theirs.items():
            mine = ours[name]
            if torch_error is None:
                continue  # torch accepts it; covered by the behaviour tests
            assert mine is not None, f"{name}: torch raises {torch_error[0]}, we do not"
            _, torch_runtime, torch_value = torch_error
            if torch_runtime:
                assert mine[1], f"{name}: torch raises a RuntimeError, we raise {mine[0]}"
            if torch_value:
                assert mine[2], f"{name}: torch raises a ValueError, we raise {mine[0]}"

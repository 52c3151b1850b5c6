"""hp-dmodule's row-parallel ``Linear`` given a plain input: its shard works, the full input is refused.

A plain input to ``Linear.Config.rowwise`` is taken as this rank's ``Shard(-1)`` slice of
the input features (``torch.chunk``'s sizes). Oracle: the same linear on full tensors in
one process, from the gathered weights. The full input must fail with one error naming
the module, the input's shape and the layout it expected (the check ``RowwiseParallel``
uses, from ``hyper_parallel.dtensor.parallel``), before any op runs or warns.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule.layers.linear import Linear
from hyper_parallel.dtensor import DTensor, init_device_mesh


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rowwise_plain_inputs() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    out: dict[str, Any] = {}
    for features in (8, 7):  # even, and uneven (chunks 4 and 3) over 2 ranks
        layer = Linear.Config.rowwise(features, 4, bias=True).build()
        layer.parallelize(mesh)
        torch.manual_seed(0)
        layer.init_states()
        x = torch.randn(3, features, generator=torch.Generator().manual_seed(features))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                layer(x)
                out[f"{features} full"] = "no error"
            except RuntimeError as error:
                out[f"{features} full"] = str(error)
        out[f"{features} warnings"] = [str(w.message) for w in caught]
        shard = x.chunk(2, dim=-1)[rank].clone().requires_grad_()
        y = layer(shard)
        y.sum().backward()
        out[f"{features} shard"] = {
            "x": x,
            "y": _full(y).detach(),
            "grad": shard.grad,
            "weight": _full(layer.weight).detach(),
            "bias": _full(layer.bias).detach(),
        }
    return out


def test_rowwise_linear_given_the_full_input_names_module_shape_and_layout() -> None:
    for rank, got in enumerate(run_on_ranks(_rowwise_plain_inputs, 2, timeout_s=240)):
        for features in (8, 7):
            expected_last = -(-features // 2) if rank == 0 else features - -(-features // 2)
            assert got[f"{features} full"] == (
                f"Linear: got a plain input of shape (3, {features}) (the full input), but the "
                "declared input layout is Shard(-1) on mesh axis 'tp' (2 ranks), so a plain "
                f"tensor is taken as this rank's shard of the {features} input features: "
                f"expected last dim {expected_last}; pass this rank's shard of 'x', a DTensor, "
                "or declare in_src_shardings={'x': <Replicate on those axes>} to pass the full "
                "input"
            ), (rank, features)
            # refused before any op ran: no fallback warning, no matmul error
            assert got[f"{features} warnings"] == [], (rank, features)
            # this rank's shard, uneven too, is the one-process linear forward and backward
            run = got[f"{features} shard"]
            want = run["x"] @ run["weight"].T + run["bias"]
            assert_close_to_scale(run["y"], want, what=f"rank {rank}: output ({features})")
            grad = torch.ones(3, 4) @ run["weight"]
            assert_close_to_scale(
                run["grad"], grad.chunk(2, dim=-1)[rank], what=f"rank {rank}: x grad ({features})"
            )

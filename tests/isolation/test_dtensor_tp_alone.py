"""hp-dtensor alone (its wheel and platform adapter, no hp-dmodule) runs torch's TP and FSDP2 APIs.

A fresh venv gets hp-dtensor's wheel with hp-platform-torch; a script there
parallelizes a plain ``torch.nn`` MLP (Embedding, LayerNorm, RMSNorm, Linear) with
``hyper_parallel.dtensor.parallel`` on 2 gloo ranks and trains one step under
``loss_parallel``; a second script shards an MLP with TP and ``fully_shard`` on
(dp=2, tp=2) over 4 ranks and trains one step. Oracle: the same model and step on full
tensors in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hp_workspace import PACKAGES, create_venv, install_from_wheels, installed, run

pytestmark = pytest.mark.isolation

SCRIPT = """
import copy, importlib.util, sys
import torch, torch.nn as nn, torch.nn.functional as F
from hyper_parallel.dtensor import Replicate, Shard, init_device_mesh
from hyper_parallel.dtensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
)
from hyper_parallel.platform_torch.launch import run_distributed


def build():
    torch.manual_seed(0)
    return nn.ModuleDict({
        "emb": nn.Embedding(16, 8), "ln": nn.LayerNorm(8), "up": nn.Linear(8, 16),
        "down": nn.Linear(16, 8), "norm": nn.RMSNorm(8), "head": nn.Linear(8, 16, bias=False),
    })


def step(m, tokens, labels):
    h = m["ln"](m["emb"](tokens))
    h = m["norm"](m["down"](F.relu(m["up"](h))))
    loss = F.cross_entropy(m["head"](h).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss


def rank_step(tokens, labels):
    mesh = init_device_mesh("cpu", (2,))
    m = build()
    parallelize_module(m, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(),
        "down": RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
    with loss_parallel():
        loss = step(m, tokens, labels)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in m.named_parameters()}
    return float(loss.item()), grads, [n for n in sys.modules if n.startswith("hyper_parallel.dmodule")]


if __name__ == "__main__":
    assert importlib.util.find_spec("hyper_parallel.dmodule") is None, "hp-dmodule is installed"
    gen = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 16, (2, 4), generator=gen), torch.randint(0, 16, (2, 4), generator=gen)
    ref = build()
    want = step(ref, tokens, labels)
    for loss, grads, dmodule in run_distributed(rank_step, 2, args=(tokens, labels), timeout_s=240):
        assert not dmodule, dmodule
        assert abs(loss - float(want)) <= 1e-5 * abs(float(want)), (loss, float(want))
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-4 * float(p.grad.abs().max()))
    print("tp ok")
"""

FSDP_SCRIPT = """
import importlib.util, sys
import torch, torch.nn as nn, torch.nn.functional as F
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.fsdp import fully_shard
from hyper_parallel.dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel.platform_torch.launch import run_distributed


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8)))


def rank_step(x, y):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = build()
    parallelize_module(m[1], mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m[1], mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    dp = mesh.get_local_rank("dp")
    F.mse_loss(m(x[dp * 2 : dp * 2 + 2]), y[dp * 2 : dp * 2 + 2]).backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return grads, [n for n in sys.modules if n.startswith("hyper_parallel.dmodule")]


if __name__ == "__main__":
    assert importlib.util.find_spec("hyper_parallel.dmodule") is None, "hp-dmodule is installed"
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 8, generator=gen)
    ref = build()
    F.mse_loss(ref(x), y).backward()
    for grads, dmodule in run_distributed(rank_step, 4, args=(x, y), timeout_s=240):
        assert not dmodule, dmodule
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-4 * float(p.grad.abs().max()))
    print("fsdp ok")
"""


def test_hp_dtensor_alone_runs_a_torch_tp_example(
    tmp_path: Path, wheels: dict[str, Path], constraints: Path
) -> None:
    python = create_venv(tmp_path / "venv")
    install_from_wheels(python, PACKAGES["hp-dtensor"], wheels, constraints=constraints)
    assert "hp-dmodule" not in installed(python)
    script = tmp_path / "tp_example.py"
    script.write_text(SCRIPT)
    assert run([python, script], cwd=tmp_path).strip().endswith("tp ok")
    fsdp_script = tmp_path / "fsdp_tp_example.py"
    fsdp_script.write_text(FSDP_SCRIPT)
    assert run([python, fsdp_script], cwd=tmp_path).strip().endswith("fsdp ok")

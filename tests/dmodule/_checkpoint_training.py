"""A tiny tensor-parallel training loop shared by the checkpoint tests (run inside rank processes)."""

from __future__ import annotations

from typing import Any

import torch

from hyper_parallel.dmodule.checkpoint import ModelState, TrainingState
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.training import average_gradients, synthetic_batch
from hyper_parallel.dtensor import DeviceMesh, DTensor, init_device_mesh

CONFIG = Llama.Config(vocab_size=24, dim=16, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=24)
BATCH, SEQ = 4, 8


def build(
    dp: int, tp: int, seed: int, optimizer: str = "adamw", config: Llama.Config = CONFIG
) -> tuple[DeviceMesh | None, Llama, torch.optim.Optimizer]:
    """A model on a (dp, tp) mesh (tp=0: not parallelized) and its optimizer."""
    mesh = None if tp == 0 else init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model: Llama = config.build()
    model.init_weights()
    if mesh is not None:
        model.parallelize(mesh["tp"])
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9, foreach=False)
    return mesh, model, opt


def train(
    mesh: DeviceMesh | None,
    model: Llama,
    opt: torch.optim.Optimizer,
    state: TrainingState,
    steps: int,
) -> list[float]:
    """``steps`` steps; each batch's seed is drawn from the global RNG, so resuming needs it."""
    losses = []
    dp = 1 if mesh is None else mesh.size("dp")
    dp_rank = 0 if mesh is None else mesh.get_local_rank("dp")
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for _ in range(steps):
        seed = int(torch.randint(0, 1 << 30, ()))
        tokens, targets = synthetic_batch(
            state.data_position, batch_size=BATCH, seq_len=SEQ, vocab_size=24, seed=seed
        )
        loss = model.loss(tokens[rows], targets[rows])
        loss.backward()  # type: ignore[no-untyped-call]
        if mesh is not None:
            average_gradients(model, mesh, "dp")
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_dp(loss.detach(), mesh))
        state.step += 1
        state.data_position += 1
    return losses


def _mean_over_dp(loss: torch.Tensor, mesh: DeviceMesh | None) -> float:
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    if mesh is not None and mesh.size("dp") > 1:
        value = value.clone()
        torch.distributed.all_reduce(value, group=mesh.get_group("dp"))
        value /= mesh.size("dp")
    return float(value)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def app_state(
    model: Llama, opt: torch.optim.Optimizer, train_state: TrainingState
) -> dict[str, Any]:
    return {"app": ModelState(model, opt), "train": train_state}

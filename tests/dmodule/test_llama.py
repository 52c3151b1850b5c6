"""The reference Llama: forward, backward and optimizer-step parity with one process (tp, dp x tp)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks

from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.training import average_gradients, synthetic_batch
from hyper_parallel.dtensor import DTensor, init_device_mesh
from hyper_parallel.platform import get_platform

# (name, dp, tp, use_local_map, sequence_parallel)
VARIANTS_WS2 = [
    ("tp2-dtensor", 1, 2, False, False),
    ("tp2-local_map", 1, 2, True, False),
    ("tp2-dtensor-sp", 1, 2, False, True),
]
VARIANTS_WS4 = [
    ("dp2xtp2-dtensor", 2, 2, False, False),
    ("dp2xtp2-local_map-sp", 2, 2, True, True),
]
STEPS, BATCH, SEQ = 2, 4, 8


def _tiny(local_map: bool, sp: bool) -> Llama.Config:
    return Llama.Config(
        vocab_size=48,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        max_seq_len=16,
        use_local_map=local_map,
        sequence_parallel=sp,
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _max_diff(par: torch.nn.Module, ref: torch.nn.Module, grads: bool) -> float:
    pairs = zip(par.parameters(), ref.parameters(), strict=True)
    if grads:
        return max((_full(_grad(p)) - _grad(q)).abs().max().item() for p, q in pairs)
    return max((_full(p) - q).abs().max().item() for p, q in pairs)


def _parity(dp: int, tp: int, local_map: bool, sp: bool) -> dict[str, Any]:
    """Train the parallel model (meta-initialised) and a one-process copy; every difference."""
    platform = get_platform()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    config = _tiny(local_map, sp)
    torch.manual_seed(0)
    ref = config.build()
    ref.init_weights()
    with torch.device("meta"):
        par = config.build()
    par.parallelize(mesh["tp"])
    par.to_empty(device="cpu")
    torch.manual_seed(0)
    par.init_weights()
    out: dict[str, Any] = {"init": _max_diff(par, ref, grads=False), "steps": []}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    rows = slice(
        mesh.get_local_rank("dp") * BATCH // dp, (mesh.get_local_rank("dp") + 1) * BATCH // dp
    )
    for step in range(STEPS):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=48)
        logits_ref = ref(tokens)
        loss_ref = ref.loss(tokens, targets)
        loss_ref.backward()
        logits_par = par(tokens[rows])
        loss_par = par.loss(tokens[rows], targets[rows])
        loss_par.backward()
        average_gradients(par, mesh, "dp")
        loss_avg = platform.all_reduce(loss_par.detach(), mesh.get_group("dp"), "avg")
        logits = (_full(logits_par) - logits_ref[rows]).abs().max().item()
        grads = _max_diff(par, ref, grads=True)
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
        out["steps"].append(
            {
                "logits": logits,
                "loss_rel": abs(loss_avg.item() - loss_ref.item()) / abs(loss_ref.item()),
                "grads": grads,
                "params": _max_diff(par, ref, grads=False),
            }
        )
    return out


def _run_variants(variants: list[tuple[str, int, int, bool, bool]]) -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: _parity(dp, tp, lm, sp) for name, dp, tp, lm, sp in variants}


def _parallelize_odd_heads() -> str:
    model = Llama.Config(n_heads=3, n_kv_heads=3, dim=24).build()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    try:
        model.parallelize(mesh)
    except ValueError as error:
        assert not any(isinstance(p, DTensor) for p in model.parameters())
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def ws2() -> dict[str, Any]:
    return run_on_ranks(_run_variants, 2, VARIANTS_WS2, timeout_s=300)[0]


@pytest.fixture(scope="module")
def ws4() -> dict[str, Any]:
    return run_on_ranks(_run_variants, 4, VARIANTS_WS4, timeout_s=300)[0]


def _check(result: dict[str, Any]) -> None:
    assert result["init"] == 0.0, "meta-device init differs from the one-process init"
    for step, found in enumerate(result["steps"]):
        assert found["logits"] < 1e-5, f"step {step}: logits differ by {found['logits']}"
        assert found["loss_rel"] < 1e-5, f"step {step}: loss differs by {found['loss_rel']} rel"
        assert found["grads"] < 1e-6, f"step {step}: gradients differ by {found['grads']}"
        assert found["params"] < 1e-4, (
            f"step {step}: params after AdamW differ by {found['params']}"
        )


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS_WS2])
def test_llama_tp2_matches_single_process(ws2: dict[str, Any], name: str) -> None:
    _check(ws2[name])


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS_WS4])
def test_llama_dp2_x_tp2_matches_single_process(ws4: dict[str, Any], name: str) -> None:
    _check(ws4[name])


def test_llama_parallelize_rejects_heads_not_dividing_tp_and_changes_nothing() -> None:
    message = run_on_ranks(_parallelize_odd_heads, 2, timeout_s=120)[0]
    assert "n_heads (3)" in message and "'tp' (2)" in message


def test_llama_is_registered_as_llama_ref_spec() -> None:
    config = get_spec("llama-ref").config("debug")
    assert isinstance(config, Llama.Config)
    model = config.replace(n_layers=1).build()
    model.verify_module_protocol()
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    assert model(tokens).shape == (2, 8, config.vocab_size)


def test_llama_config_overrides_reach_the_blocks() -> None:
    config = Llama.Config().apply_overrides(["dim=32", "n_heads=2", "use_local_map=true"])
    block = config.block()
    assert block.attention.dim == 32 and block.attention.n_heads == 2
    assert block.feed_forward.sharding_config is not None
    assert block.feed_forward.sharding_config.local_map is not None

"""Context parallelism's contract beyond parity: local activation sizes, cp collectives, checkpoints, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hyper_parallel.dmodule.context_parallel import check_inputs
from hyper_parallel.dmodule.layers import Attention
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import CommDebugMode, DTensor, init_device_mesh

CONFIG = Llama.Config(
    vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32
)
BATCH, SEQ = 2, 16


def _model(algorithm: str = "allgather", **fields: Any) -> Llama:
    torch.manual_seed(0)
    model: Llama = CONFIG.replace(context_parallel=algorithm, **fields).build()
    model.init_weights()
    return model


def _tokens(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 32, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _backward(model: Llama) -> None:
    loss = model.loss(_tokens(), _tokens())
    torch.autograd.backward(loss)


def _activation_shapes() -> dict[str, list[int]]:
    """Shapes of the local tensors entering and leaving block 0's parts, per algorithm."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    shapes: dict[str, list[int]] = {}
    for algorithm in ("allgather", "ring", "alltoall"):
        model = _model(algorithm).parallelize(mesh)
        block = model.layers[0]

        def record(name: str, algorithm: str = algorithm) -> Any:
            def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
                shapes[f"{algorithm}:{name}:in"] = list(_local(args[0]).shape)
                shapes[f"{algorithm}:{name}:out"] = list(_local(output).shape)

            return hook

        for name in ("attention", "feed_forward", "attention_norm"):
            block.get_submodule(name).register_forward_hook(record(name))
        block.register_forward_hook(record("block"))
        _backward(model)
    return shapes


def _cp_collectives() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {}
    for algorithm in ("allgather", "ring", "alltoall"):
        model = _model(algorithm).parallelize(mesh)
        with CommDebugMode(model) as comm:
            _backward(model)
        records = comm.records()
        out[algorithm] = {
            "axes": sorted({str(r.mesh_axis) for r in records}),
            "kinds": sorted({r.kind for r in records}),
        }
    return out


def _bad_inputs() -> dict[str, str]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    errors: dict[str, str] = {}
    model = _model().parallelize(mesh)
    try:
        model.loss(_tokens(14), _tokens(14))  # 14 tokens do not cut into 2 * cp = 4 chunks
    except ValueError as error:
        errors["seq"] = str(error)
    try:
        model(_tokens(), document_ids=torch.zeros(BATCH, SEQ + 1, dtype=torch.long))
    except ValueError as error:
        errors["docs"] = str(error)
    with check_inputs():
        tokens = _tokens()
        if mesh.get_local_rank("cp") == 1:
            tokens[0, 5] += 1
        try:
            model.loss(tokens, _tokens())
        except ValueError as error:
            errors["differ"] = str(error)
        targets = _tokens()
        targets[1, 0] = -100 if mesh.get_local_rank("cp") == 1 else 0
        try:
            model.loss(_tokens(), targets)
        except ValueError as error:
            errors["differ_targets"] = str(error)
    # alltoall with one key/value head on two cp ranks: refused before anything changes
    single_kv = _model("alltoall", n_kv_heads=1)
    try:
        single_kv.parallelize(mesh)
    except ValueError as error:
        errors["alltoall"] = str(error)
        errors["alltoall_unchanged"] = str(single_kv.context_parallel is None)

    class PlainAttention(Attention):
        supports_context_parallel = False

    other = _model()
    plain = PlainAttention(other.layers[1].attention.config)  # type: ignore[union-attr,arg-type]
    other.layers[1].attention = plain
    try:
        other.parallelize(mesh)
    except ValueError as error:
        errors["unsupported"] = str(error)
    return errors


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return {
        "shapes": run_on_ranks(_activation_shapes, 2, timeout_s=300)[0],
        "collectives": run_on_ranks(_cp_collectives, 2, timeout_s=300)[0],
        "errors": run_on_ranks(_bad_inputs, 2, timeout_s=300)[0],
    }


@pytest.mark.parametrize("algorithm", ["allgather", "ring", "alltoall"])
def test_activations_inside_a_block_hold_seq_over_cp_tokens(
    results: dict[str, Any], algorithm: str
) -> None:
    shapes = results["shapes"]
    for name in ("block", "attention", "feed_forward", "attention_norm"):
        for side in ("in", "out"):
            got = shapes[f"{algorithm}:{name}:{side}"]
            assert got == [BATCH, SEQ // 2, CONFIG.dim], (name, side, got)


@pytest.mark.parametrize(
    ("algorithm", "kinds"),
    [
        ("allgather", {"all_gather", "reduce_scatter", "all_reduce"}),
        ("ring", {"send_recv", "all_reduce"}),
        ("alltoall", {"all_to_all", "all_reduce"}),
    ],
)
def test_comm_debug_mode_records_the_algorithms_collectives_on_axis_cp(
    results: dict[str, Any], algorithm: str, kinds: set[str]
) -> None:
    found = results["collectives"][algorithm]
    assert found["axes"] == ["cp"]
    assert kinds <= set(found["kinds"]), found["kinds"]


def test_bad_input_is_refused_naming_what_was_expected_and_found(results: dict[str, Any]) -> None:
    errors = results["errors"]
    assert "2 * cp = 4 equal chunks" in errors["seq"] and "found seq = 14" in errors["seq"]
    assert "document_ids of shape [batch, seq] = [2, 16]" in errors["docs"]
    assert "found [2, 17]" in errors["docs"]
    assert "alltoall" in errors["alltoall"] and "n_kv_heads 1" in errors["alltoall"]
    assert "mesh axis 'cp' (2)" in errors["alltoall"]
    assert errors["alltoall_unchanged"] == "True"
    assert "layers.1.attention (PlainAttention)" in errors["unsupported"]
    assert "same tokens on every rank of mesh axis 'cp'" in errors["differ"]
    assert "cp ranks [1] differing" in errors["differ"]
    assert "Llama.loss: expected the same targets" in errors["differ_targets"]
    assert "does not support context parallelism" in errors["unsupported"]


# -- checkpoints ------------------------------------------------------------------------------------
def _save_trained(path: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = _model("ring").parallelize(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model)
    opt.step()
    dcp_save(model.state_dict(), checkpoint_id=path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load_cp1(path: str) -> dict[str, torch.Tensor]:
    model = _model()
    torch.manual_seed(5)
    model.init_weights()  # other values, overwritten by the load
    state = model.state_dict()
    dcp_load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dcp_checkpoint_saved_under_cp2_loads_with_cp1(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_trained, 2, path, timeout_s=300)
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])  # cp ranks agree
    loaded = run_on_ranks(_load_cp1, 1, path, timeout_s=300)[0]
    assert loaded.keys() == saved[0].keys()
    for key, value in saved[0].items():
        assert torch.equal(loaded[key], value), key

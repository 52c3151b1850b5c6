"""The reference models' entry points a user meets first: ``model.parallelize(dims)`` is the
whole plan or a refusal, bad input is refused naming it, ``ParallelDims`` is frozen (#36).

One process (no process group: the refusals come before any mesh is built). The 4-rank
parity of ``model.parallelize(dims)`` with data parallelism, against one process, is
``tests/train/test_cp_ep.py::test_two_models_of_different_layouts_train_in_turns_as_one_process``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3, parallelize_qwen3
from hyper_parallel.dtensor import DTensor

LLAMA = Llama.Config(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=32, max_seq_len=8)
QWEN3 = Qwen3.Config(
    vocab_size=32, dim=16, n_layers=1, n_heads=2, head_dim=8, max_seq_len=8, num_experts=4
)


def _states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return not any(isinstance(p, DTensor) for p in model.parameters()) and all(
        torch.equal(after[name], value) for name, value in before.items()
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_parallelize_is_the_spec_parallelize_fn(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one way to train: model.parallelize(dims) runs the spec's parallelize_fn (no
    # job_config), so the two can never apply different parts of a layout (before:
    # model.parallelize skipped FSDP, and llama's loss left one process's from step 2)
    spec = get_spec(f"{kind}-ref")
    plan = parallelize_llama if kind == "llama" else parallelize_qwen3
    assert spec.parallelize_fn is plan
    calls: list[tuple[Any, ...]] = []

    def record(*args: Any) -> Any:
        calls.append(args)
        return args[0]

    monkeypatch.setattr(f"hyper_parallel.dmodule.models.{kind}.parallelize_{kind}", record)
    model = (LLAMA if kind == "llama" else QWEN3).build()
    dims = ParallelDims(dp_shard=4, ep=2 if kind == "qwen3" else 1, world_size=4)
    assert model.parallelize(dims) is model
    assert len(calls) == 1 and calls[0][0] is model and calls[0][1] is dims


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_plain_replicas_are_refused_by_model_parallelize_before_anything_changes(
    kind: str,
) -> None:
    # dp_replicate=2 with no FSDP: nothing in the model averages the replicas' gradients
    # (the training step does); model.parallelize alone would run them apart, silently
    model = (LLAMA if kind == "llama" else QWEN3).build()
    model.init_states()
    before = _states(model)
    dims = ParallelDims(dp_replicate=2, dp_shard=1, world_size=2)
    with pytest.raises(ValueError, match=r"dp_replicate=2 with dp_shard x cp = 1") as info:
        model.parallelize(dims)
    assert "train_step(..., average_over=(dims.batch_mesh, 'batch'))" in str(info.value)
    assert f"parallelize_{kind}" in str(info.value)
    assert _unchanged(model, before) and not dims.is_built


def test_qwen3_parallelize_refuses_context_parallelism_before_anything_changes() -> None:
    # before: Qwen3.parallelize(ParallelDims(cp=2)) ran every rank on the whole sequence
    for parallelize in (Qwen3.parallelize, parallelize_qwen3):
        model = QWEN3.build()
        model.init_states()
        before = _states(model)
        dims = ParallelDims(cp=2, dp_shard=1, world_size=2)
        with pytest.raises(ValueError, match=r"cp=2: Qwen3Attention has no context parallelism"):
            parallelize(model, dims)
        assert _unchanged(model, before) and not dims.is_built


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (8,)], ids=["no-rows", "no-positions", "1d"])
def test_an_empty_batch_is_refused_naming_the_tokens_and_their_shape(
    kind: str, shape: tuple[int, ...]
) -> None:
    # before: "cannot reshape tensor of 0 elements" from inside attention
    model = (LLAMA if kind == "llama" else QWEN3).build()
    model.init_states()
    tokens = torch.zeros(shape, dtype=torch.long)
    where = "Llama.forward" if kind == "llama" else "Qwen3.forward"
    expected = (
        f"{where}: expected tokens of shape [batch, seq] with batch >= 1 and seq >= 1, "
        f"found shape {list(shape)}"
    )
    with pytest.raises(ValueError) as info:
        model(tokens)
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        model.loss(tokens, tokens)
    assert str(info.value) == expected


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_document_ids_that_are_not_integers_are_refused(dtype: torch.dtype) -> None:
    # before: bool passed the integer check, then its subtraction failed inside torch
    model = LLAMA.build()
    model.init_states()
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError) as info:
        model(tokens, document_ids=torch.zeros(2, 4, dtype=dtype))
    assert str(info.value) == (
        f"Llama: expected document_ids as an integer tensor (e.g. torch.int64), found {dtype}"
    )


def test_parallel_dims_is_frozen_and_replace_makes_a_new_one() -> None:
    # before: dims.tp = 4 after construction was taken, then build_mesh failed on a reshape
    dims = ParallelDims(dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 4  # -1 resolved at construction
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 4  # type: ignore[misc]
    assert (dims.tp, dims.dp_shard) == (2, 4)
    wider = dataclasses.replace(dims, tp=4, dp_shard=-1)
    assert (wider.tp, wider.dp_shard, wider.world_size) == (4, 2, 8)
    with pytest.raises(ValueError, match=r"product to equal the world size"):
        dataclasses.replace(dims, tp=4)  # dp_shard=4 kept: 4 x 4 != 8
    same: Any = ParallelDims(dp_shard=4, tp=2, world_size=8)
    assert same == dims and hash(same) == hash(dims)

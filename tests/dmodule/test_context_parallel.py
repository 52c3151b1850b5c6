"""Context parallelism and packed documents in llama-ref, each against one process on the full sequence."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule.context_parallel import (
    CP_ALGORITHMS,
    head_tail_index,
    head_tail_order,
)
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dtensor import DTensor, init_device_mesh

VOCAB, BATCH, SEQ, STEPS = 48, 2, 16, 3


def _tiny(**fields: Any) -> Llama.Config:
    base: dict[str, Any] = {
        "vocab_size": VOCAB,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "ffn_dim": 48,
        "max_seq_len": 32,
    }
    base.update(fields)
    return Llama.Config(**base)


def _batch(step: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, 3] = -100  # an ignored target: the mean is over the rest
    return tokens[:, :-1], targets


def _documents(seq: int = SEQ) -> torch.Tensor:
    # lengths that do not divide by 2 * cp, a length-1 document, one document per row
    rows = [[5, 1, 7, seq - 13], [seq]]
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# -- one process: packed documents ---------------------------------------------------------------
def test_head_tail_order_gives_every_rank_chunks_r_and_2cp_minus_1_minus_r() -> None:
    order = head_tail_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    assert head_tail_index(16, 4, 1).tolist() == [2, 3, 12, 13]


def test_packed_documents_equal_each_document_alone() -> None:
    torch.manual_seed(0)
    model = _tiny().build()
    model.init_weights()
    tokens, targets = _batch(0)
    docs = _documents()
    packed = model(tokens, document_ids=docs)
    for row in range(BATCH):
        for doc in torch.unique(docs[row]).tolist():
            where = (docs[row] == doc).nonzero().flatten()
            alone = model(tokens[row : row + 1, where])
            assert_close_to_scale(packed[row : row + 1, where], alone, what=f"row {row} doc {doc}")
    # the loss and its gradients: the token-weighted mean of the documents run alone
    loss = model.loss(tokens, targets, document_ids=docs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    total, count = torch.zeros(()), 0
    for row in range(BATCH):
        for doc in torch.unique(docs[row]).tolist():
            where = (docs[row] == doc).nonzero().flatten()
            logits = model(tokens[row : row + 1, where])
            t = targets[row : row + 1, where]
            total = total + F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum")
            count += int((t != -100).sum())
    want = total / count
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    assert_close_to_scale(loss, want, what="loss")
    for got, ref in zip(grads, want_grads, strict=True):
        assert_close_to_scale(got, ref, what="gradient")


def test_one_document_per_row_is_the_plain_causal_model() -> None:
    torch.manual_seed(0)
    model = _tiny().build()
    model.init_weights()
    tokens, _ = _batch(1)
    assert_close_to_scale(model(tokens, document_ids=torch.zeros_like(tokens)), model(tokens))


@pytest.mark.parametrize(
    ("docs", "match"),
    [
        (torch.zeros(BATCH, SEQ - 1, dtype=torch.long), r"shape \[batch, seq\] = \[2, 16\]"),
        (torch.zeros(BATCH, SEQ), "integer tensor"),
        (torch.ones(BATCH, SEQ, dtype=torch.long), "start at 0"),
        (
            torch.tensor([[0] * 8 + [1] * 4 + [0] * 4, [0] * 16]),
            r"non-decreasing.*row 0 at position 12 \(1 -> 0\)",
        ),
    ],
)
def test_bad_document_ids_are_refused_naming_what_was_found(docs: torch.Tensor, match: str) -> None:
    model = _tiny().build()
    model.init_weights()
    tokens, _ = _batch(0)
    with pytest.raises(ValueError, match=match):
        model(tokens, document_ids=docs)


def test_unknown_context_parallel_algorithm_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"context_parallel.*'ring'.*found 'rings'"):
        _tiny(context_parallel="rings")


# -- cp ranks --------------------------------------------------------------------------------------
def _train(
    algorithm: str,
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    packed: bool = False,
    config_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a cp model and a one-process copy for STEPS AdamW steps; the worst differences."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    config = _tiny(context_parallel=algorithm, **(config_fields or {}))
    torch.manual_seed(0)
    ref = config.build()
    ref.init_weights()
    par = config.build()
    par.load_state_dict(ref.state_dict())
    par.parallelize(mesh)  # an initialised model: parallelize keeps its values
    docs = _documents() if packed else None
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    worst: dict[str, float] = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
    for step in range(STEPS):
        tokens, targets = _batch(step)
        loss_ref = ref.loss(tokens, targets, document_ids=docs)
        loss_ref.backward()
        loss_par = par.loss(tokens, targets, document_ids=docs)
        loss_par.backward()
        with torch.no_grad():
            logits = _full(par(tokens, document_ids=docs))
            logits_ref = ref(tokens, document_ids=docs)
        worst["loss"] = max(worst["loss"], abs(loss_par.item() - loss_ref.item()) / loss_ref.item())
        worst["logits"] = max(worst["logits"], _rel(logits, logits_ref))
        for p, q in zip(par.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            worst["grads"] = max(worst["grads"], _rel(_full(p.grad), q.grad))
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    for (_, p), (_, q) in zip(par.named_parameters(), ref.named_parameters(), strict=True):
        worst["params"] = max(worst["params"], _rel(_full(p), q.detach()))
    names_match = [n for n, _ in par.named_parameters()] == [n for n, _ in ref.named_parameters()]
    return {"worst": worst, "names_match": names_match}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) or 1.0
    return float((got.detach() - want).abs().max()) / scale


def _cp_runs(cp: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {alg: _train(alg, (cp,), ("cp",)) for alg in CP_ALGORITHMS}
    if cp == 2:
        for alg in ("allgather", "ring", "alltoall"):
            out[f"{alg}-packed"] = _train(alg, (cp,), ("cp",), packed=True)
    return out


@pytest.fixture(scope="module")
def cp2() -> dict[str, Any]:
    return run_on_ranks(_cp_runs, 2, 2, timeout_s=300)[0]


@pytest.fixture(scope="module")
def cp4() -> dict[str, Any]:
    return run_on_ranks(_cp_runs, 4, 4, timeout_s=300)[0]


def _check(result: dict[str, Any]) -> None:
    worst = result["worst"]
    assert result["names_match"], "parameter names changed under cp"
    assert worst["loss"] < 1e-5, f"loss differs by {worst['loss']} (relative)"
    assert worst["logits"] < 1e-5, f"logits differ by {worst['logits']} (relative to their scale)"
    assert worst["grads"] < 1e-4, f"gradients differ by {worst['grads']} (relative)"
    assert worst["params"] < 1e-4, f"params after AdamW differ by {worst['params']} (relative)"


@pytest.mark.parametrize("algorithm", CP_ALGORITHMS)
def test_cp2_matches_one_process_after_three_adamw_steps(
    cp2: dict[str, Any], algorithm: str
) -> None:
    _check(cp2[algorithm])


@pytest.mark.parametrize("algorithm", CP_ALGORITHMS)
def test_cp4_matches_one_process_after_three_adamw_steps(
    cp4: dict[str, Any], algorithm: str
) -> None:
    _check(cp4[algorithm])


@pytest.mark.parametrize("algorithm", CP_ALGORITHMS)
def test_packed_documents_on_cp2_match_one_process(cp2: dict[str, Any], algorithm: str) -> None:
    _check(cp2[f"{algorithm}-packed"])

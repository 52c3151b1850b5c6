"""Context parallelism and packed documents in llama-ref, each against one process on the full sequence."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale

from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.context_parallel import (
    CP_ALGORITHMS,
    attention_work,
    balanced_assignment,
    head_tail_index,
    head_tail_order,
)
from hyper_parallel.dmodule.models.llama import Llama, parallelize_llama, pipeline_llama
from hyper_parallel.dtensor import DeviceMesh, DTensor, init_device_mesh

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


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_batches_are_split_into_equal_tokens_and_even_attention_work(cp: int) -> None:
    # one long document then many short ones: head-tail gives the tail ranks most of the work
    lengths = [96, *([4] * 8)]
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    ranks, _ = balanced_assignment(docs, cp)
    assert sorted(torch.cat(ranks).tolist()) == list(range(128))
    assert {r.numel() for r in ranks} == {128 // cp}
    work = attention_work(docs).double()
    loads = torch.stack([work[r].sum() for r in ranks])
    head_tail = torch.stack([work[head_tail_index(128, cp, r)].sum() for r in range(cp)])
    assert float(loads.max() / loads.mean()) <= 1.1
    assert float(head_tail.max() / head_tail.mean()) > 1.1  # the case needs the balancer


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
    layout: tuple[tuple[int, ...], tuple[str, ...]] | ParallelDims,
    *,
    packed: bool = False,
    job_config: dict[str, Any] | None = None,
    config_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a cp model and a one-process copy for STEPS AdamW steps; the worst differences.

    With data parallelism each group trains on its rows and the one-process loss is the
    mean of the groups' losses (what FSDP's averaging gives).
    """
    if isinstance(layout, ParallelDims):
        target: DeviceMesh | ParallelDims = layout
        dp, dp_rank = layout.dp, layout.batch_mesh.get_local_rank("batch") if layout.dp > 1 else 0
    else:
        target = init_device_mesh("cpu", layout[0], mesh_dim_names=layout[1])
        dp, dp_rank = 1, 0
    config = _tiny(context_parallel=algorithm, **(config_fields or {}))
    torch.manual_seed(0)
    ref = config.build()
    ref.init_weights()
    par = config.build()
    par.load_state_dict(ref.state_dict())
    # an initialised model: parallelizing keeps its values
    parallelize_llama(par, target, job_config) if job_config or dp > 1 else par.parallelize(target)
    docs = _documents() if packed else None
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    worst: dict[str, float] = {"loss": 0.0, "logits": 0.0, "grads": 0.0, "params": 0.0}
    rows = [slice(g * BATCH // dp, (g + 1) * BATCH // dp) for g in range(dp)]
    mine = rows[dp_rank]
    for step in range(STEPS):
        tokens, targets = _batch(step)
        losses = [
            ref.loss(tokens[r], targets[r], document_ids=None if docs is None else docs[r])
            for r in rows
        ]
        (sum(losses) / dp).backward()
        my_docs = None if docs is None else docs[mine]
        loss_par = par.loss(tokens[mine], targets[mine], document_ids=my_docs)
        loss_par.backward()
        with torch.no_grad():
            logits = _full(par(tokens[mine], document_ids=my_docs))
            logits_ref = ref(tokens[mine], document_ids=my_docs)
        want = losses[dp_rank].item()
        worst["loss"] = max(worst["loss"], abs(loss_par.item() - want) / want)
        worst["logits"] = max(worst["logits"], _rel(logits, logits_ref))
        for p, q in _pairs(par, ref):
            assert p.grad is not None and q.grad is not None, "a parameter got no gradient"
            worst["grads"] = max(worst["grads"], _rel(_full(p.grad), q.grad))
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    for p, q in _pairs(par, ref):
        worst["params"] = max(worst["params"], _rel(_full(p), q.detach()))
    names_match = [n for n, _ in par.named_parameters()] == [n for n, _ in ref.named_parameters()]
    return {"worst": worst, "names_match": names_match}


def _pairs(par: torch.nn.Module, ref: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    theirs = dict(ref.named_parameters())
    return [(p, theirs[name]) for name, p in par.named_parameters()]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) or 1.0
    return float((got.detach() - want).abs().max()) / scale


def _pipeline_train(
    algorithm: str,
    layout: tuple[tuple[int, ...], tuple[str, ...]] | ParallelDims,
    *,
    packed: bool = False,
) -> dict[str, Any]:
    """pp=2 x cp=2: train this rank's stage and a one-process model; the worst differences.

    Two microbatches of one row each, with different counts of ignored targets.
    """
    target: DeviceMesh | ParallelDims = (
        layout
        if isinstance(layout, ParallelDims)
        else init_device_mesh("cpu", layout[0], mesh_dim_names=layout[1])
    )
    config = _tiny(context_parallel=algorithm)
    with torch.device("meta"):
        model = config.build()
    pipe = pipeline_llama(model, target, {"pipeline": {"schedule": "1F1B", "n_microbatches": 2}})
    torch.manual_seed(0)
    pipe.init_weights()
    torch.manual_seed(0)
    ref = config.build()
    ref.init_weights()
    mine = {name: p for part in pipe.model_parts for name, p in part.named_parameters()}
    theirs = dict(ref.named_parameters())
    worst = {"init": 0.0, "loss": 0.0, "grads": 0.0, "params": 0.0}
    for name, p in mine.items():
        worst["init"] = max(worst["init"], _rel(_full(p), theirs[name].detach()))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(mine.values(), lr=1e-2, foreach=False)
    docs = {"document_ids": _documents()} if packed else {}
    tokens, targets = _batch(0, seq=SEQ - 2)  # 14 tokens: not 2 * cp = 4 equal chunks
    short = {name: ids[:, : SEQ - 2] for name, ids in docs.items()}
    try:
        pipe.step(tokens, target=targets, **short)
        refused = "no error"
    except ValueError as error:  # on every rank, before the schedule exchanged anything
        refused = str(error)
    losses = 0
    for step in range(STEPS):
        tokens, targets = _batch(step)
        want = ref.loss(tokens, targets, **docs)
        want.backward()
        loss = pipe.step(tokens, target=targets, **docs)
        if loss is not None:
            losses += 1
            worst["loss"] = max(worst["loss"], abs(loss.item() - want.item()) / want.item())
        for name, p in mine.items():
            assert p.grad is not None, f"{name} got no gradient"
            worst["grads"] = max(worst["grads"], _rel(_full(p.grad), theirs[name].grad))
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    for name, p in mine.items():
        worst["params"] = max(worst["params"], _rel(_full(p), theirs[name].detach()))
    return {
        "worst": worst,
        "held": sorted(mine),
        "losses": losses,
        "all": sorted(theirs),
        "refused": refused,
    }


def _cp_runs(cp: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = ((cp,), ("cp",))
    out = {alg: _train(alg, mesh) for alg in CP_ALGORITHMS}
    if cp == 2:
        for alg in CP_ALGORITHMS:
            out[f"{alg}-packed"] = _train(alg, mesh, packed=True)
        out["ring-checkpointed"] = _train(
            "ring", mesh, job_config={"activation_checkpoint": "full"}
        )
    else:  # 4 ranks: compositions
        for alg in CP_ALGORITHMS:
            out[f"{alg}-cp2xtp2"] = _train(alg, ((2, 2), ("cp", "tp")))
        out["allgather-cp2xtp2-local_map-dims"] = _train(
            "allgather", ParallelDims(cp=2, tp=2), config_fields={"use_local_map": True}
        )
        out["ring-cp2xdp_shard2"] = _train("ring", ParallelDims(dp_shard=2, cp=2), packed=True)
        out["allgather-cp2xdp_shard2-mesh"] = _train("allgather", ((2, 2), ("dp_shard", "cp")))
        out["pp2xcp2-allgather-mesh"] = _pipeline_train("allgather", ((2, 2), ("pp", "cp")))
        out["pp2xcp2-ring-packed-dims"] = _pipeline_train(
            "ring", ParallelDims(pp=2, cp=2), packed=True
        )
    return out


@pytest.fixture(scope="module")
def cp2() -> dict[str, Any]:
    return run_on_ranks(_cp_runs, 2, 2, timeout_s=300)[0]


@pytest.fixture(scope="module")
def cp4_ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_cp_runs, 4, 4, timeout_s=300)


@pytest.fixture(scope="module")
def cp4(cp4_ranks: list[dict[str, Any]]) -> dict[str, Any]:
    return cp4_ranks[0]


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


def test_cp2_with_activation_checkpointing_matches_one_process(cp2: dict[str, Any]) -> None:
    _check(cp2["ring-checkpointed"])


@pytest.mark.parametrize("algorithm", CP_ALGORITHMS)
def test_cp2_x_tp2_matches_one_process(cp4: dict[str, Any], algorithm: str) -> None:
    _check(cp4[f"{algorithm}-cp2xtp2"])


def test_cp2_x_tp2_local_map_from_parallel_dims_matches_one_process(cp4: dict[str, Any]) -> None:
    _check(cp4["allgather-cp2xtp2-local_map-dims"])


@pytest.mark.parametrize("name", ["ring-cp2xdp_shard2", "allgather-cp2xdp_shard2-mesh"])
def test_cp2_x_dp_shard2_fsdp_matches_one_process(cp4: dict[str, Any], name: str) -> None:
    _check(cp4[name])


@pytest.mark.parametrize("name", ["pp2xcp2-allgather-mesh", "pp2xcp2-ring-packed-dims"])
def test_pp2_x_cp2_pipeline_matches_one_process_after_three_adamw_steps(
    cp4_ranks: list[dict[str, Any]], name: str
) -> None:
    results = [rank[name] for rank in cp4_ranks]
    # the two stages hold every parameter between them; the last stage's two cp ranks the loss
    assert sorted({n for r in results for n in r["held"]}) == results[0]["all"]
    assert sum(r["losses"] for r in results) == 2 * STEPS
    for result in results:  # a sequence of 14 tokens, refused by every rank; training goes on
        assert "2 * cp = 4 equal chunks" in result["refused"], result["refused"]
        assert "found seq = 14" in result["refused"], result["refused"]
    for result in results:
        worst = result["worst"]
        assert worst["init"] == 0.0, "the stages' init differs from one process's"
        assert worst["loss"] < 1e-5, f"loss differs by {worst['loss']} (relative)"
        assert worst["grads"] < 1e-4, f"gradients differ by {worst['grads']} (relative)"
        assert worst["params"] < 1e-4, f"params after AdamW differ by {worst['params']} (relative)"

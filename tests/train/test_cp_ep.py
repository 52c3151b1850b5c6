"""Context and expert parallelism in hp-train: 2 ranks train as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import tiny_job, write_corpus

from hyper_parallel.config import ConfigError
from hyper_parallel.train.cli import preflight
from hyper_parallel.train.trainer import RunSummary, train

#: qwen3-ref with 4 routed experts; a large balancing coefficient so that the bias moves routing
TINY_MOE = [
    "model.name=qwen3-ref",
    "model.flavor=debug-moe",
    'model.config={"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "head_dim": 8, '
    '"moe_ffn_dim": 16, "num_experts": 4, "top_k": 2, "max_seq_len": 16, '
    '"load_balance_coeff": 0.05}',
]


def _runs(corpus: str, cp: list[str], ep: list[str]) -> tuple[RunSummary, RunSummary] | None:
    """The tiny llama-ref job with the ``cp`` overrides, the tiny MoE job with ``ep``'s."""
    steps = "training.steps=3"
    llama = train(tiny_job(Path(corpus), steps, *cp), log=False)
    moe = train(tiny_job(Path(corpus), steps, *TINY_MOE, *ep), log=False)
    return None if llama is None or moe is None else (llama, moe)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunSummary, RunSummary]]:
    corpus = str(write_corpus(tmp_path_factory.mktemp("corpus")))
    (one,) = run_on_ranks(_runs, 1, corpus, [], [], timeout_s=240)
    two = run_on_ranks(
        _runs,
        2,
        corpus,
        ["parallelism.cp=2"],
        ["parallelism.dp_shard=2", "parallelism.ep=2"],
        timeout_s=240,
    )[0]
    assert one is not None and two is not None
    return {"one": one, "two": two}


def test_context_parallel_llama_trains_as_one_process(
    runs: dict[str, tuple[RunSummary, RunSummary]],
) -> None:
    # cp=2: both ranks read the same batch, each scores half of every packed sequence
    # (documents kept apart by document_ids); the one-process losses and gradient norms
    one, two = runs["one"][0], runs["two"][0]
    torch.testing.assert_close(
        torch.tensor(two.losses), torch.tensor(one.losses), rtol=1e-4, atol=0
    )
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-4)
    assert one.losses[-1] < one.losses[0]


def test_expert_parallel_moe_trains_as_one_process(
    runs: dict[str, tuple[RunSummary, RunSummary]],
) -> None:
    # ep=2 over dp_shard=2: each rank owns 2 of the 4 experts and reads half the batch; the
    # balancing bias moves by the global token counts after each step, as in one process
    one, two = runs["one"][1], runs["two"][1]
    torch.testing.assert_close(
        torch.tensor(two.losses), torch.tensor(one.losses), rtol=1e-4, atol=0
    )
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-4)


def test_cp_and_ep_on_models_without_them_are_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="has no context parallelism") as error:
        preflight(tiny_job(corpus, *TINY_MOE, "parallelism.cp=2"), resume=False)
    assert error.value.path == "parallelism.cp"
    with pytest.raises(ConfigError, match="has no routed experts") as error:
        preflight(tiny_job(corpus, "parallelism.dp_shard=2", "parallelism.ep=2"), resume=False)
    assert error.value.path == "parallelism.ep"

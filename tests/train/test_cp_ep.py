"""Context and expert parallelism in hp-train, alone and with pp and tp: ranks train as one
process does."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import initial_model, tiny_job, write_corpus

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.dmodule.layers import moe_aux_loss
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dtensor import DTensor, clip_grad_norm_, collectives
from hyper_parallel.train.cli import preflight
from hyper_parallel.train.data import BatchSampler
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import load_samples, train

#: qwen3-ref with 4 routed experts; a large balancing coefficient so that the bias moves routing
TINY_MOE = [
    "model.name=qwen3-ref",
    "model.flavor=debug-moe",
    'model.config={"dim": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "head_dim": 8, '
    '"moe_ffn_dim": 16, "num_experts": 4, "top_k": 2, "max_seq_len": 16, '
    '"load_balance_coeff": 0.5}',
    "optimizer.lr=0.1",
]


def _runs(
    corpus: str, cp: list[str] | None, ep: list[str] | None, *more: list[str]
) -> dict[str, Any] | None:
    """The tiny llama-ref job with the ``cp`` overrides, the tiny MoE job with ``ep``'s; on one
    rank also the MoE job with balancing all but off, one step with an auxiliary loss
    next to its oracle (the same init's loss plus ``moe_aux_loss`` on the first batch), and
    both two-block models (for pipelines). ``None`` skips a job. ``more``: further jobs,
    each ``[name, *overrides]``, run one after the other in this process (keyed by name)."""
    steps = "training.steps=3"
    runs: dict[str, Any] = {}
    if cp is not None:
        runs["llama"] = train(tiny_job(Path(corpus), steps, *cp), log=False)
    if ep is not None:
        runs["moe"] = train(tiny_job(Path(corpus), steps, *TINY_MOE, *ep), log=False)
    for name, *overrides in more:
        runs[name] = train(tiny_job(Path(corpus), steps, *overrides), log=False)
    if torch.distributed.get_world_size() == 1:
        still = "model.config.load_balance_coeff=1e-12"
        runs["unbalanced"] = train(tiny_job(Path(corpus), steps, *TINY_MOE, still), log=False)
        runs["llama2"] = train(tiny_job(Path(corpus), steps, TWO_BLOCKS), log=False)
        runs["moe2"] = train(tiny_job(Path(corpus), steps, *TINY_MOE, TWO_BLOCKS), log=False)
        job = tiny_job(
            Path(corpus), "training.steps=1", *TINY_MOE, "model.config.aux_loss_coeff=0.5"
        )
        runs["aux"] = train(job, log=False)
        model = initial_model(job, Qwen3)
        samples, _ = load_samples(job, ByteTokenizer())
        (batch,) = BatchSampler(
            samples, seed=0, dp_rank=0, dp=1, local_batch=4, accumulation=1
        ).next_step()
        with torch.no_grad():
            ce = model.loss(batch.tokens, batch.targets)
            aux = moe_aux_loss(model)
        assert aux is not None
        runs["aux_oracle"] = (float(ce), float(ce + aux))
        runs["interleaved"] = _interleaved()
    return None if any(run is None for run in runs.values()) else runs


#: a pipeline of 2 stages needs 2 blocks: these jobs and their one-process oracles have them
TWO_BLOCKS = "model.config.n_layers=2"
#: 4 ranks: each layout against the one-process job of the same model ("llama2" / "moe2")
FOUR_RANK_JOBS = {
    "pp2_cp2": ("llama2", [TWO_BLOCKS, "parallelism.pp=2", "parallelism.cp=2"]),
    "pp2_ep2": (
        "moe2",
        [*TINY_MOE, TWO_BLOCKS, "parallelism.pp=2", "parallelism.dp_shard=2", "parallelism.ep=2"],
    ),
    "tp2_ep2": (
        "moe",
        [*TINY_MOE, "parallelism.dp_shard=2", "parallelism.tp=2", "parallelism.ep=2"],
    ),
    "tp2_ep2_etp2": (
        "moe",
        [
            *TINY_MOE,
            "parallelism.dp_shard=2",
            "parallelism.tp=2",
            "parallelism.ep=2",
            "parallelism.etp=2",
        ],
    ),
}


#: the four layouts' jobs run this many times over in one process group
ROUNDS = 2


def _four_rank_runs(corpus: str) -> dict[str, Any]:
    """Every 4-rank layout's job, ``ROUNDS`` times over, then two models of different layouts
    trained in turns, all in one process group (an RL loop's actor and critic, a notebook).

    Garbage collection is skewed on purpose: off on even ranks, run before each job on odd
    ones, so an earlier job's meshes are alive on some ranks and gone on others. A lookup by
    value that could pick either (they are equal meshes) then hung in ``clip_grad_norm_``'s
    all-reduce, two ranks on two different process groups."""
    rank = torch.distributed.get_rank()
    runs: dict[str, Any] = {}
    if rank % 2 == 0:
        gc.disable()
    try:
        for round_ in range(ROUNDS):
            for name, (_, overrides) in FOUR_RANK_JOBS.items():
                if rank % 2:
                    gc.collect()
                ran = _runs(corpus, None, None, [name, *overrides])
                runs[f"{name}#{round_}"] = None if ran is None else ran[name]
        runs["interleaved"] = _interleaved()
    finally:
        gc.enable()
    return runs


#: llama-ref and a qwen3-ref MoE, each with the degrees it trains on over 4 ranks
INTERLEAVED: dict[str, tuple[Llama.Config | Qwen3.Config, dict[str, int]]] = {
    "llama": (
        Llama.Config(
            vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32, max_seq_len=8
        ),
        {"dp_shard": 2, "tp": 2},
    ),
    "moe": (
        Qwen3.Config(
            vocab_size=64,
            dim=16,
            n_layers=1,
            n_heads=2,
            n_kv_heads=2,
            head_dim=8,
            moe_ffn_dim=16,
            num_experts=4,
            top_k=2,
            max_seq_len=8,
        ),
        {"dp_shard": 4, "ep": 2},
    ),
}


def _interleaved(steps: int = 3, batch: int = 8) -> dict[str, tuple[list[float], list[float]]]:
    """Both ``INTERLEAVED`` models trained step by step in turns (AdamW, clipped): each
    step's mean loss and gradient norm. On several ranks each model goes through
    ``model.parallelize(dims)`` (its whole plan: TP or EP, then FSDP over the data ranks)
    and each rank reads its rows of the batch; in one process the plain models read it all
    and clip with torch's ``clip_grad_norm_`` (the oracle)."""
    world = torch.distributed.get_world_size()
    trained: list[tuple[Any, ParallelDims | None, torch.optim.Optimizer, list[float], list[float]]]
    trained = []
    for config, degrees in INTERLEAVED.values():
        with torch.device("meta"):
            model = config.build()
        dims = ParallelDims(**degrees) if world > 1 else None
        if dims is not None:
            model.parallelize(dims)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights(buffer_device=torch.device("cpu"))
        adamw = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
        trained.append((model, dims, adamw, [], []))
    for step in range(steps):
        for model, dims, optimizer, losses, norms in trained:
            tokens, targets = synthetic_batch(step, batch_size=batch, seq_len=8, vocab_size=64)
            if dims is not None:
                rank, dp = dims.batch_mesh.get_local_rank("batch"), dims.dp
                rows = slice(rank * batch // dp, (rank + 1) * batch // dp)
                tokens, targets = tokens[rows], targets[rows]
            loss = model.loss(tokens, targets)
            loss.backward()  # type: ignore[no-untyped-call]
            params = list(model.parameters())
            if dims is None:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
            else:
                norm = clip_grad_norm_(params, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach()
            mean = mean.full_tensor() if isinstance(mean, DTensor) else mean
            if dims is not None:
                mean = collectives.all_reduce(mean, dims.batch_mesh, "batch", "avg")
            losses.append(float(mean))
            norms.append(float(norm))
    return {name: (run[3], run[4]) for name, run in zip(INTERLEAVED, trained, strict=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    corpus = str(write_corpus(tmp_path_factory.mktemp("corpus")))
    (one,) = run_on_ranks(_runs, 1, corpus, [], [], timeout_s=240)
    ep = ["parallelism.dp_shard=2", "parallelism.ep=2"]
    two = run_on_ranks(_runs, 2, corpus, ["parallelism.cp=2"], ep, timeout_s=240)[0]
    four = run_on_ranks(_four_rank_runs, 4, corpus, timeout_s=400)[0]
    assert one is not None and two is not None
    return {"one": one, "two": two, "four": four}


def test_context_parallel_llama_trains_as_one_process(
    runs: dict[str, dict[str, Any]],
) -> None:
    # cp=2: both ranks read the same batch, each scores half of every packed sequence
    # (documents kept apart by document_ids); the one-process losses and gradient norms
    one, two = runs["one"]["llama"], runs["two"]["llama"]
    torch.testing.assert_close(
        torch.tensor(two.losses), torch.tensor(one.losses), rtol=1e-4, atol=0
    )
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-4)
    assert one.losses[-1] < one.losses[0]


def test_expert_parallel_moe_trains_as_one_process(
    runs: dict[str, dict[str, Any]],
) -> None:
    # ep=2 over dp_shard=2: each rank owns 2 of the 4 experts and reads half the batch; the
    # balancing bias moves by the global token counts after each step, as in one process
    one, two = runs["one"]["moe"], runs["two"]["moe"]
    torch.testing.assert_close(
        torch.tensor(two.losses), torch.tensor(one.losses), rtol=1e-4, atol=0
    )
    assert two.grad_norms == pytest.approx(one.grad_norms, rel=1e-4)
    # the balancing update does move routing: without it the third step differs
    unbalanced = runs["one"]["unbalanced"]
    assert unbalanced.losses[0] == pytest.approx(one.losses[0], rel=1e-6)
    assert abs(unbalanced.losses[2] - one.losses[2]) > 1e-3 * abs(one.losses[2])


@pytest.mark.parametrize("layout", sorted(FOUR_RANK_JOBS))
def test_pipelines_and_tp_with_cp_or_ep_train_as_one_process(
    runs: dict[str, dict[str, Any]], layout: str
) -> None:
    # pp=2 x cp=2 (llama-ref, stages cut the sequence at the embedding), pp=2 x ep=2 (MoE
    # blocks on both stages, the bias moved per stage), ep borrowing tp's ranks, ep x etp
    # each run ROUNDS times in one process group, after the other layouts' jobs (the known
    # hang: an equal mesh of an earlier job found by value, its process groups not this one's)
    oracle = FOUR_RANK_JOBS[layout][0]
    one = runs["one"][oracle]
    for round_ in range(ROUNDS):
        four = runs["four"][f"{layout}#{round_}"]
        torch.testing.assert_close(
            torch.tensor(four.losses), torch.tensor(one.losses), rtol=1e-4, atol=0
        )
        assert four.grad_norms == pytest.approx(one.grad_norms, rel=1e-4)


@pytest.mark.parametrize("model", sorted(INTERLEAVED))
def test_two_models_of_different_layouts_train_in_turns_as_one_process(
    runs: dict[str, dict[str, Any]], model: str
) -> None:
    # llama-ref on dp_shard=2 x tp=2 and a qwen3-ref MoE on dp_shard=4 x ep=2, one step of
    # each in turn, each through model.parallelize(dims) (FSDP included), clipped: the
    # one-process losses and gradient norms (whole batch, torch's clip_grad_norm_)
    one_losses, one_norms = runs["one"]["interleaved"][model]
    four_losses, four_norms = runs["four"]["interleaved"][model]
    torch.testing.assert_close(
        torch.tensor(four_losses), torch.tensor(one_losses), rtol=1e-4, atol=0
    )
    assert four_norms == pytest.approx(one_norms, rel=1e-4)
    assert one_losses[-1] < one_losses[0]


def test_the_aux_loss_is_added_to_the_training_loss(
    runs: dict[str, dict[str, Any]],
) -> None:
    ce, with_aux = runs["one"]["aux_oracle"]
    assert runs["one"]["aux"].losses[0] == pytest.approx(with_aux, rel=1e-5)
    assert with_aux > ce * (1 + 1e-4)  # the oracle's aux term is not negligible


def test_cp_and_ep_on_models_without_them_are_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="has no context parallelism") as error:
        preflight(tiny_job(corpus, *TINY_MOE, "parallelism.cp=2"), resume=False)
    assert error.value.path == "parallelism.cp"
    with pytest.raises(ConfigError, match="has no routed experts") as error:
        preflight(tiny_job(corpus, "parallelism.dp_shard=2", "parallelism.ep=2"), resume=False)
    assert error.value.path == "parallelism.ep"
    with pytest.raises(ConfigError, match="has no routed experts to split over etp") as error:
        preflight(
            tiny_job(corpus, "parallelism.dp_shard=2", "parallelism.tp=2", "parallelism.etp=2"),
            resume=False,
        )
    assert error.value.path == "parallelism.etp"
    aux = [*TINY_MOE, TWO_BLOCKS, "parallelism.pp=2", "model.config.aux_loss_coeff=0.1"]
    with pytest.raises(ConfigError, match="auxiliary loss is not added through a pipeline"):
        preflight(tiny_job(corpus, *aux), resume=False)
    with pytest.raises(ConfigError, match=r"expected a multiple of 2 x parallelism\.cp = 4"):
        preflight(tiny_job(corpus, "parallelism.cp=2", "training.seq_len=14"), resume=False)

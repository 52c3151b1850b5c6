"""The trainer on one rank: SIGTERM saves and resumes, a Hugging Face start, FLOPs, bad input."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import initial_model, tiny_job, write_corpus

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.checkpoint import CheckpointMismatchError
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.train.cli import preflight
from hyper_parallel.train.config import JobConfig, batch_layout, load_job
from hyper_parallel.train.data import BatchSampler
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import (
    RunSummary,
    build_model_config,
    check_layout,
    load_samples,
    train,
)


def _terminate_after(jsonl: Path, records: int) -> None:
    """Send this process SIGTERM once ``jsonl`` holds ``records`` lines."""
    while not (jsonl.is_file() and len(jsonl.read_text().splitlines()) >= records):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)


def _sigterm_then_resume(corpus: str, root: str) -> dict[str, Any]:
    logged = [f"checkpoint.dir={root}/ckpt", f"metrics.jsonl={root}/m.jsonl", "training.steps=400"]
    watcher = threading.Thread(target=_terminate_after, args=(Path(root) / "m.jsonl", 2))
    watcher.start()
    stopped = train(tiny_job(Path(corpus), *logged))
    watcher.join()
    assert stopped is not None
    at = len(stopped.losses)
    resumed = train(tiny_job(Path(corpus), *logged[:2], f"training.steps={at + 2}"), resume=True)
    straight = train(tiny_job(Path(corpus), f"training.steps={at + 2}"), log=False)
    try:  # the same directory resumed by a model of another shape
        train(
            tiny_job(
                Path(corpus), *logged[:2], f"training.steps={at + 5}", "model.config.ffn_dim=48"
            ),
            resume=True,
        )
        mismatch = ""
    except CheckpointMismatchError as error:
        mismatch = str(error)
    assert resumed is not None and straight is not None
    return {"stopped": stopped, "resumed": resumed, "straight": straight, "mismatch": mismatch}


def test_sigterm_saves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    (out,) = run_on_ranks(_sigterm_then_resume, 1, str(corpus), str(tmp_path), timeout_s=240)
    stopped, resumed, straight = out["stopped"], out["resumed"], out["straight"]
    at = len(stopped.losses)
    assert stopped.stopped_by_signal and 2 <= at < 400
    assert stopped.last_checkpoint.endswith(f"step-{at}")
    assert resumed.first_step == at + 1
    torch.testing.assert_close(
        torch.tensor(stopped.losses + resumed.losses),
        torch.tensor(straight.losses),
        rtol=1e-5,
        atol=0,
    )
    assert "mis-shaped keys" in out["mismatch"] and "feed_forward.w1.weight" in out["mismatch"]


transformers = pytest.importorskip("transformers")


def _write_hf_llama(directory: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def _hf_job(directory: Path, corpus: Path, *overrides: str) -> JobConfig:
    return JobConfig().apply_overrides(
        [
            f"model.hf_dir={directory}",
            f"data.path={corpus}",
            "training.seq_len=16",
            "training.global_batch_size=4",
            "training.steps=1",
            *overrides,
        ]
    )


def _train_job(job: JobConfig) -> Any:
    return train(job, log=False)


def test_fine_tuning_from_a_transformers_llama_starts_at_its_loss(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    _write_hf_llama(tmp_path / "hf")
    job = _hf_job(tmp_path / "hf", corpus, f"checkpoint.export_hf={tmp_path}/out")
    (summary,) = run_on_ranks(_train_job, 1, job, timeout_s=240)
    # the oracle: transformers' model on the first batch the job reads
    train_samples, _ = load_samples(job, ByteTokenizer())
    local, accumulation = batch_layout(job)
    (batch,) = BatchSampler(
        train_samples, seed=0, dp_rank=0, dp=1, local_batch=local, accumulation=accumulation
    ).next_step()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # the job packs documents and llama-ref attends within each one (document_ids), so
    # transformers runs each document alone: the same logits, position for position
    with torch.no_grad():
        logits = torch.stack(
            [
                torch.cat(
                    [
                        hf(part.unsqueeze(0)).logits[0]
                        for part in row.split(
                            torch.unique_consecutive(docs, return_counts=True)[1].tolist()
                        )
                    ]
                )
                for row, docs in zip(batch.tokens, batch.document_ids, strict=True)
            ]
        )
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
    assert summary.losses[0] == pytest.approx(float(want), rel=1e-5)
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.config.hidden_size == 16  # written as a transformers directory


def test_an_hf_directory_of_another_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(
        ConfigError, match=r"model.hf_dir: .*expected model_type 'llama', found 'gpt2'"
    ):
        preflight(_hf_job(tmp_path / "gpt", write_corpus(tmp_path / "c")), resume=False)


def test_a_tokenizer_vocabulary_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    job = tiny_job(write_corpus(tmp_path), "model.config.vocab_size=200")
    with pytest.raises(ConfigError, match="tokenizer's 257 ids, found vocab_size = 200") as error:
        preflight(job, resume=False)
    assert error.value.path == "model.config.vocab_size"


#: qwen3-ref with routed experts, so that an etp degree reaches ParallelDims' own check
TINY_MOE_MODEL = ["model.name=qwen3-ref", "model.flavor=debug-moe"]


def test_resume_without_a_checkpoint_and_a_layout_off_the_world_are_refused(tmp_path: Path) -> None:
    job = tiny_job(write_corpus(tmp_path), f"checkpoint.dir={tmp_path}/none")
    with pytest.raises(ConfigError, match="expected a committed checkpoint"):
        preflight(job, resume=True)
    with pytest.raises(ConfigError, match=r"etp must be 1 or tp \(2\), found etp=3") as error:
        preflight(
            tiny_job(tmp_path, *TINY_MOE_MODEL, "parallelism.tp=2", "parallelism.etp=3"),
            resume=False,
        )
    assert error.value.path == "parallelism"


def test_flops_per_token_equal_a_hand_count_for_llama_ref() -> None:
    cfg = Llama.Config(
        vocab_size=257, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=16
    )
    d, v, f, hd, kv, L, s = 16, 257, 32, 8, 1, 2, 16
    per_layer = d * d + 2 * d * kv * hd + d * d + 3 * d * f + 2 * d  # wq wk wv wo, w1 w2 w3, norms
    matmul_params = L * per_layer + d + d * v  # + final norm + output (embedding excluded)
    want = 6 * matmul_params + 12 * L * 2 * hd * s
    with torch.device("meta"):
        model = cfg.build()
    nparams, flops = cfg.get_nparams_and_flops(model, s)
    assert nparams == matmul_params + v * d
    assert flops == want


def test_keep_removes_all_but_the_newest_committed_checkpoints(tmp_path: Path) -> None:
    from hyper_parallel.train.trainer import _keep_last

    for step in (5, 10, 15):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / ".metadata").write_text("")
    (tmp_path / ".step-20.partial").mkdir()  # a save in flight is not touched
    _keep_last(JobConfig().apply_overrides([f"checkpoint.dir={tmp_path}", "checkpoint.keep=2"]), 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-20.partial", "step-10", "step-15"]


def _train_bfloat16(corpus: str) -> RunSummary | None:
    return train(tiny_job(Path(corpus), "training.param_dtype=bfloat16", "training.steps=2"))


def test_bfloat16_runs_the_forward_under_autocast_on_one_process(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    (summary,) = run_on_ranks(_train_bfloat16, 1, str(corpus), timeout_s=240)
    assert summary is not None
    # the oracle: the job's initial model on its first batch, the forward under torch's autocast
    job = tiny_job(corpus, "training.param_dtype=bfloat16")
    model = initial_model(job, Llama)
    train_samples, _ = load_samples(job, ByteTokenizer())
    local, accumulation = batch_layout(job)
    (batch,) = BatchSampler(
        train_samples, seed=0, dp_rank=0, dp=1, local_batch=local, accumulation=accumulation
    ).next_step()
    with torch.no_grad():
        full = model.loss(batch.tokens, batch.targets, document_ids=batch.document_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model.loss(batch.tokens, batch.targets, document_ids=batch.document_ids)
    assert summary.losses[0] == pytest.approx(float(mixed), rel=1e-6)
    # and not float32's: the tolerance above tells the two apart
    assert summary.losses[0] != pytest.approx(float(full), rel=1e-6)
    assert summary.losses[1] < summary.losses[0]


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["parallelism.pp=2"], "training.param_dtype", r"float32 with pp = 2"),
        (
            ["parallelism.pp=2", "training.param_dtype=float32", "training.reduce_dtype=bfloat16"],
            "training.reduce_dtype",
            r"float32 with pp = 2",
        ),
        (["parallelism.tp=2"], "training.param_dtype", r"float32 with tp = 2 and no FSDP"),
        (
            ["training.param_dtype=float32", "training.reduce_dtype=bfloat16"],
            "training.reduce_dtype",
            "gradients are reduced in",
        ),
    ],
)
def test_mixed_precision_layouts_not_run_are_refused_by_key(
    overrides: list[str], key: str, message: str, tmp_path: Path
) -> None:
    job = tiny_job(tmp_path, "training.param_dtype=bfloat16", *overrides)
    with pytest.raises(ConfigError, match=message) as error:
        check_layout(job, 2 if job.parallelism.world_size == 2 else 1)
    assert error.value.path == key
    with pytest.raises(ConfigError, match="float16 needs loss scaling"):
        load_job(None, ["training.param_dtype=float16"])


def test_document_ids_reach_the_model_only_for_rows_that_pack_several_documents() -> None:
    from hyper_parallel.train.data import pack
    from hyper_parallel.train.trainer import _model_inputs

    # 8 + 6 + 4 tokens (EOS each): samples aaaa, aaaE, bbbb, bEcc
    samples = pack(["a" * 7, "b" * 5, "c" * 3], ByteTokenizer(), seq_len=4)
    one_each = _model_inputs(samples.batch([0, 1]), torch.device("cpu"))
    packed = _model_inputs(samples.batch([1, 3]), torch.device("cpu"))
    assert len(one_each) == 2 and len(packed) == 3
    # the premise: one document per row is plain causal attention (the oracle: no ids at all)
    config = build_model_config(tiny_job(Path("unused")), 257)
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    tokens, targets = one_each
    with torch.no_grad():
        plain = model.loss(tokens, targets)
        masked = model.loss(tokens, targets, document_ids=torch.zeros_like(tokens))
    assert float(masked) == pytest.approx(float(plain), rel=1e-6)

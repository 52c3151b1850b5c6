"""Exact resume: interrupted and resumed gives the uninterrupted run's losses (pipelines too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.train._jobs import tiny_job, write_aligned_corpus, write_corpus

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.checkpoint import read_manifest
from hyper_parallel.train.cli import preflight
from hyper_parallel.train.trainer import RunSummary, build_model_config, check_layout, train


def _three_runs(layout: list[str], corpus: str, root: str) -> tuple[RunSummary, ...] | None:
    """An uninterrupted 10-step run, then a 5-step run that checkpoints, resumed to step 10."""
    torch.manual_seed(1234)  # the job seeds init itself: another state here must not matter
    full = train(tiny_job(Path(corpus), *layout, "training.steps=10"), log=False)
    logged = [
        "checkpoint.interval=5",
        f"checkpoint.dir={root}/ckpt",
        f"metrics.jsonl={root}/metrics.jsonl",
        f"metrics.tensorboard_dir={root}/tb",
        "validation.interval=5",
    ]
    first = train(tiny_job(Path(corpus), *layout, *logged, "training.steps=5"))
    torch.manual_seed(99)  # the checkpoint restores the generators
    if torch.distributed.get_rank() == 0:  # as if step 6 was logged before a crash
        with open(f"{root}/metrics.jsonl", "a") as jsonl:
            jsonl.write(json.dumps({"step": 6, "loss": -1.0}) + "\n")
    resumed = train(tiny_job(Path(corpus), *layout, *logged, "training.steps=10"), resume=True)
    if full is None or first is None or resumed is None:
        return None
    return full, first, resumed


@pytest.mark.parametrize(
    # dp_shard = -1: the rest of the 2-rank world, resolved by each rank
    "layout",
    [["parallelism.tp=2"], ["parallelism.dp_shard=-1"]],
    ids=["tp2", "dp_shard_rest"],
)
def test_resume_at_step_5_gives_the_uninterrupted_losses(layout: list[str], tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    results = run_on_ranks(_three_runs, 2, layout, str(corpus), str(tmp_path), timeout_s=240)
    assert results[0] is not None
    full, first, resumed = results[0]
    assert (first.first_step, resumed.first_step) == (1, 6)
    assert len(resumed.losses) == 5
    # the same step on the same data from the same state: the same numbers, run after run
    torch.testing.assert_close(
        torch.tensor(first.losses + resumed.losses), torch.tensor(full.losses), rtol=1e-5, atol=0
    )
    assert first.lrs + resumed.lrs == full.lrs
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    # rank 0 alone wrote; the resumed run appended after the checkpoint's step (dropping the
    # crashed run's step 6): steps 1..10 once each
    assert [r["step"] for r in train_records] == list(range(1, 11))
    assert [r["loss"] for r in train_records] == first.losses + resumed.losses
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_second"} <= set(train_records[0])
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-10", "step-5"]
    if layout == ["parallelism.tp=2"]:
        _the_left_checkpoints_are_checked_before_any_process_starts(tmp_path, corpus)
    # TensorBoard's own reader sees the scalars of both runs under the documented tags
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss/train", "loss/val", "lr", "grad_norm"} <= set(events.Tags()["scalars"])
    by_step = {e.step: e.value for e in events.Scalars("loss/train")}
    assert sorted(by_step) == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor([by_step[s] for s in range(1, 11)]),
        torch.tensor(full.losses),
        rtol=1e-5,
        atol=0,
    )


def _the_left_checkpoints_are_checked_before_any_process_starts(root: Path, corpus: Path) -> None:
    """hp-train's preflight on the checkpoints of a finished run (no process is started)."""
    logged = ["parallelism.tp=2", f"checkpoint.dir={root}/ckpt", "training.steps=12"]
    job = tiny_job(corpus, *logged)
    manifest = read_manifest(root / "ckpt" / "step-10")
    assert manifest is not None
    assert manifest["info"] == {
        "model": "llama-ref",
        "flavor": "debug",
        "seed": 0,
        "data_path": str(corpus),
    }
    # a fresh run into them is refused, naming the newest step
    with pytest.raises(ConfigError, match="holding checkpoints up to step 10"):
        preflight(job, resume=False)
    assert preflight(job, resume=True) == 2
    # a changed seed or data path: warned; another model shape: refused by key
    with pytest.warns(UserWarning, match=r"training.seed = 0, this job has 7"):
        preflight(job.apply_overrides(["training.seed=7"]), resume=True)
    wider = job.apply_overrides(
        [
            'model.config={"dim": 32, "n_layers": 1, "n_heads": 2, '
            '"n_kv_heads": 2, "ffn_dim": 32, "max_seq_len": 16}'
        ]
    )
    with pytest.raises(
        ConfigError, match=r"saved from another \(.*saved \[.*16\], this job's"
    ) as e:
        preflight(wider, resume=True)
    assert e.value.path == "model.config"
    # damage in the newest: refused naming the checkpoint and the file, pointing to step 5
    (shard,) = sorted((root / "ckpt" / "step-10").glob("__1_*.distcp"))
    with shard.open("r+b") as f:
        f.write(bytes(64))
    with pytest.raises(ConfigError) as e:
        preflight(job, resume=True)
    assert f"checkpoint '{root / 'ckpt' / 'step-10'}' is damaged: {shard.name} has SHA-256" in str(
        e.value
    )
    assert "--checkpoint.resume_step=5" in str(e.value)
    assert preflight(job.apply_overrides(["checkpoint.resume_step=5"]), resume=True) == 2
    with pytest.raises(ConfigError, match=r"step 7 .* found steps \[5, 10\]") as e:
        preflight(job.apply_overrides(["checkpoint.resume_step=7"]), resume=True)
    assert e.value.path == "checkpoint.resume_step"


def _pipeline_and_tensor_parallel(corpus: str) -> tuple[RunSummary, RunSummary] | None:
    """The same job on 2 ranks as a 2-stage pipeline (GPipe) and as tp=2."""
    pipelined = train(
        tiny_job(
            Path(corpus),
            "parallelism.pp=2",
            "parallelism.pipeline_schedule=GPipe",
            "model.config.n_layers=2",
            "training.steps=4",
        ),
        log=False,
    )
    tensor = train(
        tiny_job(Path(corpus), "parallelism.tp=2", "model.config.n_layers=2", "training.steps=4"),
        log=False,
    )
    return None if pipelined is None or tensor is None else (pipelined, tensor)


def test_a_pipeline_trains_as_tensor_parallel_does(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    result = run_on_ranks(_pipeline_and_tensor_parallel, 2, str(corpus), timeout_s=240)[0]
    assert result is not None
    pipelined, tensor = result
    # the same steps (clipping across both stages included) on another layout: the same losses
    torch.testing.assert_close(
        torch.tensor(pipelined.losses), torch.tensor(tensor.losses), rtol=1e-4, atol=0
    )
    assert pipelined.grad_norms == pytest.approx(tensor.grad_norms, rel=1e-4)


#: A 2-stage pipeline of the tiny model (one block per stage) on 2 ranks.
PIPELINE = ["parallelism.pp=2", "model.config.n_layers=2"]


def _pipeline_stopped_at_3_and_resumed(corpus: str, root: str) -> tuple[RunSummary, ...] | None:
    """pp=2: 6 steps straight; 3 steps that checkpoint, resumed to step 6; validation at 3, 6."""
    straight = train(
        tiny_job(Path(corpus), *PIPELINE, "validation.interval=3", "training.steps=6"), log=False
    )
    logged = ["validation.interval=3", "checkpoint.interval=3", f"checkpoint.dir={root}/ckpt"]
    first = train(tiny_job(Path(corpus), *PIPELINE, *logged, "training.steps=3"), log=False)
    torch.manual_seed(99)  # the checkpoint restores the generators
    export = f"checkpoint.export_hf={root}/hf-pp"
    resumed = train(
        tiny_job(Path(corpus), *PIPELINE, *logged, export, "training.steps=6"),
        resume=True,
        log=False,
    )
    if straight is None or first is None or resumed is None:
        return None
    return straight, first, resumed


def _one_process_six_steps(corpus: str, root: str) -> RunSummary | None:
    job = tiny_job(Path(corpus), "model.config.n_layers=2", "validation.interval=3")
    export = f"checkpoint.export_hf={root}/hf-one"
    return train(job.apply_overrides(["training.steps=6", export]), log=False)


def test_a_pipeline_resumed_at_step_3_trains_and_validates_as_one_process(tmp_path: Path) -> None:
    # documents fill whole samples: no sample packs two (a pipeline does not carry
    # document_ids between its stages), so one process on the same batches is the oracle
    corpus = write_aligned_corpus(tmp_path / "corpus")
    staged = run_on_ranks(_pipeline_stopped_at_3_and_resumed, 2, str(corpus), str(tmp_path))[0]
    (one,) = run_on_ranks(_one_process_six_steps, 1, str(corpus), str(tmp_path))
    assert staged is not None and one is not None
    straight, first, resumed = staged
    assert (first.first_step, resumed.first_step) == (1, 4)
    # exact resume: the same numbers as the uninterrupted pipeline run
    assert first.losses + resumed.losses == straight.losses
    assert {**first.val_losses, **resumed.val_losses} == straight.val_losses
    torch.testing.assert_close(
        torch.tensor(first.losses + resumed.losses), torch.tensor(one.losses), rtol=1e-5, atol=0
    )
    assert first.lrs + resumed.lrs == one.lrs
    # validation runs forward only through the schedule: one process's loss on the same samples
    assert sorted({**first.val_losses, **resumed.val_losses}) == [3, 6]
    got = torch.tensor([first.val_losses[3], resumed.val_losses[6]])
    torch.testing.assert_close(got, torch.tensor([one.val_losses[3], one.val_losses[6]]))
    # each rank saved its own stage: together, every state of the whole model
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / "step-3")).read_metadata()
    model_keys = {k.removeprefix("app.model.") for k in saved.state_dict_metadata if "model." in k}
    with torch.device("meta"):
        whole = build_model_config(tiny_job(corpus, *PIPELINE), 257).build()
    assert model_keys == set(whole.state_dict())
    assert any(k.startswith("app.optim.state.layers.1.") for k in saved.state_dict_metadata)
    # the Hugging Face export gathers both stages: one process's exported weights
    from safetensors.torch import load_file

    staged_hf = load_file(tmp_path / "hf-pp" / "model.safetensors")
    one_hf = load_file(tmp_path / "hf-one" / "model.safetensors")
    assert sorted(staged_hf) == sorted(one_hf)
    for key, want in one_hf.items():
        assert_close_to_scale(staged_hf[key], want, rel=1e-4, what=key)


def test_pipeline_batches_that_do_not_divide_into_microbatches_are_refused(tmp_path: Path) -> None:
    three = [*PIPELINE, "parallelism.pipeline_microbatches=3"]
    with pytest.raises(ConfigError, match=r"training batch .* \(4 samples\) to divide into .* = 3"):
        check_layout(tiny_job(tmp_path, *three), 2)
    accumulate = ["training.gradient_accumulation_steps=2", "validation.interval=1"]
    with pytest.raises(ConfigError, match=r"validation batch .* \(2 samples\)") as error:
        check_layout(
            tiny_job(tmp_path, *PIPELINE, *accumulate, "parallelism.pipeline_microbatches=4"), 2
        )
    assert error.value.path == "validation.interval"

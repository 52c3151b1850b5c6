"""Jobs on prepared data: the raw text's samples and losses, exact resume, mixtures, flat startup, bad input."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._harness import run_on_ranks
from tests.train._jobs import tiny_job, write_corpus

from hyper_parallel.config import ConfigError
from hyper_parallel.train.cli import preflight
from hyper_parallel.train.config import JobConfig, load_job
from hyper_parallel.train.data import PackedSamples, Prefetcher
from hyper_parallel.train.job_data import check_data, load_job_data, make_sampler
from hyper_parallel.train.mixture import Mixture, MixtureSampler
from hyper_parallel.train.prepare import PrepareOptions, prepare
from hyper_parallel.train.tokenizer import ByteTokenizer
from hyper_parallel.train.trainer import RunSummary, train


def _prepared(corpus: Path, out: Path) -> Path:
    prepare(PrepareOptions(str(corpus), str(out), workers=1, part_bytes=1_500))  # several shards
    return out


def test_prepared_samples_are_the_texts_samples_training_and_held_out(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = _prepared(corpus, tmp_path / "out")
    held = tmp_path / "held.txt"
    held.write_text("validation text, " * 40)
    held_out = _prepared(held, tmp_path / "held-prepared")
    assert len(list(out.glob("tokens-*.bin"))) > 1  # samples cross shard boundaries
    for text_job, prepared_job in (
        (tiny_job(corpus), tiny_job(out)),  # the held-out tail
        (tiny_job(corpus, f"validation.path={held}"), tiny_job(out, f"validation.path={held_out}")),
    ):
        raw = load_job_data(text_job, ByteTokenizer())
        mapped = load_job_data(prepared_job, ByteTokenizer())
        for a, b in ((raw.train, mapped.train), (raw.validation, mapped.validation)):
            assert isinstance(a, PackedSamples) and isinstance(b, PackedSamples)
            assert len(a) == len(b) > 0
            for i in range(len(a)):
                assert all(torch.equal(x, y) for x, y in zip(a.sample(i), b.sample(i), strict=True))
        assert raw.identity == "" and len(mapped.identity) == 64


def _jobs_on_prepared(corpus: str, prepared: str, mix: str, root: str) -> list[RunSummary] | None:
    """Text vs prepared (4 steps); prepared and a mixture saved at step 2 and resumed to 4.

    Several jobs share this launch: ``gc.collect()`` before each makes every rank drop the
    previous job's meshes at the same point (meshes are looked up by value while alive:
    the known issue of several jobs in one process, README).
    """
    layout = ["parallelism.dp_shard=2", "validation.interval=2"]

    def run(path: str, *overrides: str, resume: bool = False) -> RunSummary | None:
        gc.collect()
        return train(tiny_job(Path(path), *layout, *overrides), resume=resume, log=False)

    runs = [run(corpus, "training.steps=4")]
    for name, data in (("prepared", []), ("mix", ["data.path=", f"data.mix={mix}"])):
        runs.append(run(prepared, *data, "training.steps=4"))
        saved = [*data, f"checkpoint.dir={root}/{name}", "checkpoint.interval=2"]
        run(prepared, *saved, "training.steps=2")
        runs.append(run(prepared, *saved, "training.steps=4", resume=True))
    return None if any(r is None for r in runs) else [r for r in runs if r is not None]


def test_prepared_data_trains_as_the_text_and_resumes_exactly_mixtures_too(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", documents=16)
    prepared = _prepared(corpus, tmp_path / "prepared")
    other = _prepared(write_corpus(tmp_path / "other", documents=8), tmp_path / "other-prepared")
    mix = json.dumps([{"path": str(prepared), "weight": 0.6}, {"path": str(other), "weight": 0.4}])
    results = run_on_ranks(
        _jobs_on_prepared, 2, str(corpus), str(prepared), mix, str(tmp_path), timeout_s=300
    )
    assert results[0] is not None
    text, mapped, mapped_resumed, mixed, mixed_resumed = results[0]
    # the same samples: the same losses step for step, validation included
    assert len(text.losses) == 4 and mapped.losses == text.losses
    assert mapped.val_losses == text.val_losses
    for full, resumed in ((mapped, mapped_resumed), (mixed, mixed_resumed)):
        assert resumed.first_step == 3
        assert resumed.losses == full.losses[2:] and resumed.val_losses[4] == full.val_losses[4]
    assert mixed.losses != mapped.losses  # the other source's samples are drawn too


def test_a_mixture_draws_each_source_by_its_weight_and_resumes_from_its_position() -> None:
    from hyper_parallel.train.data import pack

    sources = tuple(
        pack([chr(97 + s) * (400 * (s + 1))], ByteTokenizer(), seq_len=4) for s in range(3)
    )
    weights = (0.5, 0.3, 0.2)
    mixture = Mixture(sources, weights, ("a", "b", "c"))
    sampler = MixtureSampler(mixture, seed=5, dp_rank=0, dp=1, local_batch=500, accumulation=1)
    drawn = torch.cat([sampler.next_step()[0].tokens[:, 0] for _ in range(20)])  # 10,000
    shares = [(drawn == 97 + s).float().mean().item() for s in range(3)]
    assert all(abs(share - w) <= 0.02 for share, w in zip(shares, weights, strict=True)), shares
    # every source walks its own epochs: each sample of "a" (100 samples) read once per 100 draws
    draws = sampler.draws(0, 10_000)
    of_a = [i for s, i in draws if s == 0]
    assert sorted(of_a[:100]) == list(range(100)) and of_a[:100] != of_a[100:200]
    # two ranks split each global batch; a sampler set to a position continues exactly
    ranks = [
        MixtureSampler(mixture, seed=5, dp_rank=r, dp=2, local_batch=3, accumulation=2)
        for r in range(2)
    ]
    straight = [[r.next_step() for _ in range(9)] for r in ranks]
    for rank in range(2):
        resumed = MixtureSampler(mixture, seed=5, dp_rank=rank, dp=2, local_batch=3, accumulation=2)
        resumed.position = 4 * 12
        for expected in straight[rank][4:]:
            got = resumed.next_step()
            assert all(torch.equal(g.tokens, e.tokens) for g, e in zip(got, expected, strict=True))
    # validation (no shuffle): each source in order, the sources still interleaved
    ordered = MixtureSampler(
        mixture, seed=0, dp_rank=0, dp=1, local_batch=20, accumulation=1, shuffle=False
    )
    firsts = ordered.next_step()[0].tokens[:, 0].tolist()
    assert set(firsts) == {97, 98, 99}
    assert [i for s, i in ordered.draws(0, 200) if s == 0][:5] == [0, 1, 2, 3, 4]
    rows = [b.tokens for r in range(2) for b in straight[r][0]]
    assert torch.equal(
        torch.cat(rows),
        MixtureSampler(mixture, seed=5, dp_rank=0, dp=1, local_batch=12, accumulation=1)
        .next_step()[0]
        .tokens,
    )


def _peak_rss() -> int:
    """This process's peak RSS since the last reset (VmHWM), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def _startup(path: Path) -> tuple[float, int]:
    """Seconds and peak RSS to read a job's data, build the prefetching sampler, 3 steps."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    job = load_job(None, [f"data.path={path}", "training.seq_len=64"])
    data = load_job_data(job, ByteTokenizer())
    sampler = make_sampler(data.train, seed=0, dp_rank=0, dp=1, local_batch=8, accumulation=1)
    loader = Prefetcher(sampler)
    for _ in range(3):
        loader.next_step()
    loader.close()
    return time.perf_counter() - start, _peak_rss()


def test_startup_time_and_memory_do_not_grow_with_the_prepared_corpus(tmp_path: Path) -> None:
    """2 MB against 32 MB of tokens (bench/bench_prepare.py measures 100 MB and the text
    path): the same startup time (within 50% + 3 s) and peak memory (+200 MB)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a peak RSS")
    rng = np.random.default_rng(0)
    for name, size in {"small": 2_000_000, "large": 32_000_000}.items():
        corpus = tmp_path / name
        corpus.mkdir()
        for part in range(4):
            text = rng.integers(32, 127, size // 4, dtype=np.uint8).tobytes()
            (corpus / f"{part}.txt").write_bytes(text)
        prepare(PrepareOptions(str(corpus), str(tmp_path / f"{name}-prepared"), workers=1))
    _startup(tmp_path / "small-prepared")  # warm: first-use costs are not the corpus's
    small_seconds, small_peak = _startup(tmp_path / "small-prepared")
    large_seconds, large_peak = _startup(tmp_path / "large-prepared")
    assert large_seconds <= small_seconds * 1.5 + 3, (small_seconds, large_seconds)
    # the text path holds 16 bytes a token: 512 MB more for the large corpus
    assert large_peak <= small_peak + 200e6, (small_peak, large_peak)


def test_prepared_data_bad_input_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    out = _prepared(corpus, tmp_path / "out")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    from tokenizers import Tokenizer, models, pre_tokenizers

    made = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2}, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    made.save(str(tokenizer / "tokenizer.json"))
    other = tiny_job(out, f"tokenizer.path={tokenizer}")
    with pytest.raises(
        ValueError,
        match=r"prepared with the byte tokenizer .*, but the job's tokenizer is tokenizer.json '.*tok/tokenizer.json'",
    ):
        check_data(other)
    with pytest.raises(
        ValueError,
        match=r"expected at least one sample of training.seq_len 4096 \+ 1 tokens, found 3\d\d\d tokens",
    ):
        check_data(tiny_job(out, "training.seq_len=4096"))  # preflight's data checks
    shard = sorted(out.glob("tokens-*.bin"))[-1]
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size - 6)
    with pytest.raises(
        ValueError,
        match=rf"{shard.name}: expected {size:,} bytes \(index.json\), found {size - 6:,} bytes",
    ):
        load_job_data(tiny_job(out), ByteTokenizer())
    shard.unlink()
    with pytest.raises(
        ValueError, match=rf"{shard.name}: expected {size:,} bytes \(index.json\), found no file"
    ):
        preflight(tiny_job(out), resume=False)
    with pytest.raises(
        FileNotFoundError,
        match=r"data.path = '.*corpus': expected a directory prepared by hp-train prepare",
    ):
        check_data(tiny_job(corpus, "data.format=tokens"))
    with pytest.raises(
        FileNotFoundError, match=r"data.path = '.*empty': expected a file, a directory or a glob"
    ):
        (tmp_path / "empty").mkdir()
        preflight(tiny_job(tmp_path / "empty"), resume=False)


def test_resuming_on_other_prepared_data_is_refused_unless_allowed(tmp_path: Path) -> None:
    from hyper_parallel.train.job_data import check_resumed_data, data_identity

    out = _prepared(write_corpus(tmp_path / "a"), tmp_path / "out")
    other = _prepared(write_corpus(tmp_path / "b", documents=5), tmp_path / "other")
    saved = data_identity(tiny_job(out))
    check_resumed_data(saved, tiny_job(out), "ckpt/step-3")
    with pytest.raises(
        ConfigError,
        match=r"data.path: --resume: the checkpoint 'ckpt/step-3' was trained on prepared data [0-9a-f]{16}, this job reads prepared data",
    ):
        check_resumed_data(saved, tiny_job(other), "ckpt/step-3")
    with pytest.raises(ConfigError, match=r"this job reads text tokenized at startup"):
        check_resumed_data(saved, tiny_job(tmp_path / "a"), "ckpt/step-3")
    check_resumed_data(saved, tiny_job(other, "data.resume_on_other_data=true"), "ckpt/step-3")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.holdout=1"], r"data.holdout: expected a share in \[0, 1\)"),
        (
            ["data.holdout=0", "validation.interval=5"],
            r"data.holdout: validation.interval = 5 validates on the held-out tail",
        ),
        (
            ['data.mix=[{"path": "a", "weight": 0}]'],
            r"data.mix\[0\].weight: expected a finite weight > 0, found 0",
        ),
        (
            ["data.path=x", 'data.mix=[{"path": "a"}]'],
            r"data.mix: expected either data.path or data.mix",
        ),
    ],
)
def test_bad_data_keys_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_job(None, overrides)
    assert isinstance(JobConfig(), JobConfig)


def test_the_sampler_of_a_mixture_is_a_mixture_sampler(tmp_path: Path) -> None:
    out = _prepared(write_corpus(tmp_path / "a"), tmp_path / "out")
    mix = json.dumps([{"path": str(out), "weight": 1.0}])
    data = load_job_data(tiny_job(out, "data.path=", f"data.mix={mix}"), ByteTokenizer())
    sampler = make_sampler(data.train, seed=0, dp_rank=0, dp=1, local_batch=2, accumulation=1)
    assert isinstance(sampler, MixtureSampler) and isinstance(data.validation, Mixture)


def test_the_preflight_reads_nothing_of_prepared_data_but_its_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _prepared(write_corpus(tmp_path / "a"), tmp_path / "out")
    mapped: list[object] = []

    def fake_memmap(*args: object, **kwargs: object) -> np.ndarray:  # type: ignore[type-arg]
        mapped.append(args)
        return np.zeros(1)

    monkeypatch.setattr("numpy.memmap", fake_memmap)
    assert preflight(tiny_job(out, "parallelism.dp_shard=2"), resume=False) == 2
    assert mapped == []
    load_job_data(tiny_job(out), ByteTokenizer())  # the oracle: a job maps them
    assert len(mapped) == len(list(out.glob("*.bin")))

"""hp-train's data at scale: ``hp-train prepare`` against the in-memory path, and startup on prepared data.

Run: uv run python bench/bench_prepare.py [--mb 300] [--workers 0] [--rounds 2] [--dir DIR]

Generates a corpus of ``--mb`` MB (text files of English-like words, 4 MB each; kept in
``--dir`` for later runs), then:

(1) Throughput, byte tokenizer. Rounds alternate the two ways to tokenize the same corpus:
today's in-memory path (``pack(read_documents(...))``, what every rank ran at startup
before prepared data) and ``hp-train prepare`` with ``--workers`` processes (0: one per
core). Each side's figure is its fastest round (load from other processes only adds
time). Reported: MB/s of each and prepare / in-memory (goal: >= 4).

(2) Startup on prepared data. In a fresh process each: read the job's data (``data.path``
= the prepared corpus, seq_len 64), build the prefetching sampler and read 3 steps of 8
samples; wall seconds and the process's peak RSS, for a 2 MB and the ``--mb`` corpus
(goal: the same within 50% + 3 s and 200 MB), and the in-memory path on the ``--mb``
corpus for comparison.

(3) With ``--bpe-mb N``: a byte-level BPE (8,192 ids, trained by ``tokenizers`` on the
2 MB corpus) on the first N MB of the corpus: ``prepare`` (``--workers``) against
``tokenizers``' own ``encode_batch`` of the same documents in one process on every core
(reading the files not counted), fastest of ``--rounds``. Reported: prepare / batch
encoding (goal: >= 1, i.e. as fast).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

_WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their been has when who will more no if out so said what up its about into than them can only other new some could time these two may then do first any my now such like our over man me even most made"


def write_corpus(root: Path, megabytes: int, seed: int = 0) -> Path:
    """``megabytes`` MB of random English-like lines in files of 4 MB (reused when present)."""
    marker = root / f".complete-{megabytes}"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    words = np.array(_WORDS.split())
    per_file = 4_000_000
    for number in range(max(1, megabytes * 1_000_000 // per_file)):
        picks = words[rng.integers(0, len(words), per_file // 4)]
        text = " ".join(picks.tolist())
        lines = "\n".join(text[i : i + 100] for i in range(0, len(text), 100))
        (root / f"part-{number:04d}.txt").write_text(lines[:per_file])
    marker.touch()
    return root


def _corpus_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("*.txt"))


_TIMED = textwrap.dedent(
    """
    import sys, time
    from hyper_parallel.train.data import pack
    from hyper_parallel.train.documents import read_documents
    from hyper_parallel.train.prepare import PrepareOptions, prepare
    from hyper_parallel.train.tokenizer import ByteTokenizer
    side, corpus, out, workers = sys.argv[1:5]
    start = time.perf_counter()
    if side == "in-memory":
        samples = pack(read_documents(corpus), ByteTokenizer(), seq_len=64)
        assert len(samples) > 0
    else:
        prepare(PrepareOptions(corpus, out, workers=int(workers), overwrite=True))
    print(time.perf_counter() - start)
    """
)


def _timed(side: str, corpus: Path, out: Path, workers: int) -> float:
    """Seconds of one side's work in a fresh process (imports not counted)."""
    done = subprocess.run(
        [sys.executable, "-c", _TIMED, side, str(corpus), str(out), str(workers)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.splitlines()[-1])


_STARTUP = textwrap.dedent(
    """
    import json, sys, time
    start = time.perf_counter()
    from hyper_parallel.train.config import load_job
    from hyper_parallel.train.data import Prefetcher
    from hyper_parallel.train.job_data import load_job_data, make_sampler
    from hyper_parallel.train.tokenizer import ByteTokenizer
    job = load_job(None, [f"data.path={sys.argv[1]}", "training.seq_len=64"])
    data = load_job_data(job, ByteTokenizer())
    loader = Prefetcher(make_sampler(data.train, seed=0, dp_rank=0, dp=1, local_batch=8,
                                     accumulation=1))
    for _ in range(3):
        loader.next_step()
    loader.close()
    # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's across exec)
    status = open("/proc/self/status").read().split("VmHWM:")[1].split()[0]
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": int(status) / 1e3}))
    """
)


def _startup(path: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _STARTUP, str(path)], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


_BATCH = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(sys.argv[1])
    texts = [p.read_text() for p in sorted(Path(sys.argv[2]).glob("*.txt"))]
    start = time.perf_counter()
    tokenizer.encode_batch(texts, add_special_tokens=False)
    print(time.perf_counter() - start)
    """
)


def _bpe(root: Path, corpus: Path, small: Path, megabytes: int, rounds: int, workers: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"])
    tokenizer.train([str(p) for p in sorted(small.glob("*.txt"))], trainer)
    path = root / "bpe.json"
    tokenizer.save(str(path))
    part = root / f"bpe-corpus-{megabytes}"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir()
    for file in sorted(corpus.glob("*.txt"))[: max(1, megabytes // 4)]:
        shutil.copy(file, part / file.name)
    size = _corpus_bytes(part)
    prepared, batch = [], []
    for _ in range(rounds):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _TIMED_BPE,
                str(part),
                str(root / "bpe-out"),
                str(workers),
                str(path),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        prepared.append(float(done.stdout.splitlines()[-1]))
        done = subprocess.run(
            [sys.executable, "-c", _BATCH, str(path), str(part)],
            capture_output=True,
            text=True,
            check=True,
        )
        batch.append(float(done.stdout.splitlines()[-1]))
    print(
        f"(3) BPE (8,192 ids) on {size / 1e6:,.0f} MB: prepare {size / min(prepared) / 1e6:,.1f} MB/s, "
        f"tokenizers' encode_batch {size / min(batch) / 1e6:,.1f} MB/s: prepare / batch = "
        f"{min(batch) / min(prepared):.2f} (goal >= 1)"
    )


_TIMED_BPE = textwrap.dedent(
    """
    import sys, time
    from hyper_parallel.train.prepare import PrepareOptions, prepare
    corpus, out, workers, tokenizer = sys.argv[1:5]
    start = time.perf_counter()
    prepare(PrepareOptions(corpus, out, tokenizer_path=tokenizer, workers=int(workers), overwrite=True))
    print(time.perf_counter() - start)
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bpe-mb", type=int, default=0, help="(3): MB of the corpus with a BPE")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "hp-bench-prepare"))
    args = parser.parse_args()
    root = Path(args.dir)
    corpus = write_corpus(root / f"corpus-{args.mb}", args.mb)
    small = write_corpus(root / "corpus-2", 2)
    size = _corpus_bytes(corpus)
    out = root / f"prepared-{args.mb}"
    print(
        f"corpus: {size / 1e6:,.1f} MB in {len(list(corpus.glob('*.txt')))} files; "
        f"{os.cpu_count()} cores; workers {args.workers or os.cpu_count()}"
    )
    memory, prepared = [], []
    for round_ in range(args.rounds):
        memory.append(_timed("in-memory", corpus, out, args.workers))
        prepared.append(_timed("prepare", corpus, out, args.workers))
        print(f"  round {round_}: in-memory {memory[-1]:.1f} s, prepare {prepared[-1]:.1f} s")
    fast_memory, fast_prepare = min(memory), min(prepared)
    print(
        f"(1) in-memory {size / fast_memory / 1e6:,.1f} MB/s, prepare "
        f"{size / fast_prepare / 1e6:,.1f} MB/s: prepare / in-memory = "
        f"{fast_memory / fast_prepare:.1f}x (goal >= 4)"
    )
    small_out = root / "prepared-2"
    _timed("prepare", small, small_out, args.workers)
    small_startup, large_startup = _startup(small_out), _startup(out)
    raw_startup = _startup(corpus)
    print(
        f"(2) startup on prepared data: 2 MB {small_startup['seconds']:.2f} s, "
        f"{small_startup['peak_mb']:,.0f} MB peak; {args.mb} MB {large_startup['seconds']:.2f} s, "
        f"{large_startup['peak_mb']:,.0f} MB peak (the in-memory path on {args.mb} MB: "
        f"{raw_startup['seconds']:.1f} s, {raw_startup['peak_mb']:,.0f} MB peak)"
    )
    if args.bpe_mb:
        _bpe(root, corpus, small, args.bpe_mb, args.rounds, args.workers)


if __name__ == "__main__":
    main()

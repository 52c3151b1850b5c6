"""``hp-train prepare``: counts against a hand count, dtypes, atomic output, bad input, undecodable text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.train.cli import main
from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.documents import read_documents
from hyper_parallel.train.job_data import UndecodableTextWarning, load_job_data
from hyper_parallel.train.prepare import PrepareOptions, prepare
from hyper_parallel.train.shards import read_index, token_dtype
from hyper_parallel.train.tokenizer import BYTE_EOS, ByteTokenizer, HFTokenizer


def _mixed_corpus(root: Path) -> Path:
    """Text files (CRLF, non-ASCII, empty) and a JSONL file large enough to be cut in pieces."""
    root.mkdir(parents=True)
    (root / "a.txt").write_bytes("héllo wörld\r\nline two\rthree\n".encode())
    (root / "b.txt").write_bytes(b"")
    (root / "sub").mkdir()
    (root / "sub" / "c.txt").write_text("ünïcode ✓ " * 50)
    records = [json.dumps({"text": f"record {i} " + "é" * (i % 7), "id": i}) for i in range(300)]
    (root / "d.jsonl").write_text(
        "\n".join(records[:150]) + "\n\n" + "\n".join(records[150:]) + "\n"
    )
    return root


def _hand_stream(root: Path) -> tuple[list[int], list[int]]:
    """The byte tokenizer's stream and document starts, counted without hp-train's code."""
    texts: list[str] = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(file, encoding="utf-8", newline=None) as handle:  # universal newlines
            content = handle.read()
        if file.suffix == ".jsonl":
            texts += [json.loads(line)["text"] for line in content.split("\n") if line.strip()]
        else:
            texts.append(content)
    stream: list[int] = []
    starts: list[int] = []
    for text in texts:
        starts.append(len(stream))
        stream += [*text.encode("utf-8"), BYTE_EOS]
    return stream, starts


def _read_prepared(out: Path) -> tuple[list[int], list[int], str]:
    index = json.loads((out / "index.json").read_text())
    shards = [np.memmap(out / s["name"], dtype=index["dtype"], mode="r") for s in index["shards"]]
    starts = np.memmap(out / "documents.bin", dtype="<i8", mode="r")
    return np.concatenate(shards).tolist(), starts.tolist(), index["dtype"]


def test_prepare_counts_equal_a_hand_count_for_the_byte_tokenizer(tmp_path: Path) -> None:
    corpus = _mixed_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    # small parts: several workers' shards, the JSONL file cut at line boundaries
    summary = prepare(PrepareOptions(str(corpus), str(out), workers=2, part_bytes=2_000))
    stream, starts = _hand_stream(corpus)
    found, found_starts, dtype = _read_prepared(out)
    assert (found, found_starts, dtype) == (stream, starts, "uint16")
    index = json.loads((out / "index.json").read_text())
    assert (
        (index["documents"], index["tokens"])
        == (len(starts), len(stream))
        == (3 + 300, len(stream))
    )
    assert (summary.documents, summary.tokens) == (303, len(stream))
    assert index["tokenizer"] == {"kind": "bytes"} and len(index["shards"]) > 2
    assert all((out / s["name"]).stat().st_size == s["bytes"] for s in index["shards"])
    # the documents data.path reads, in the same order
    assert len(list(read_documents(str(corpus)))) == 303
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]  # no scratch left


def _word_tokenizer(directory: Path, words: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(words)}}
    made = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    made.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize(("words", "dtype"), [(100, "uint16"), (70_000, "uint32")])
def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(
    words: int, dtype: str, tmp_path: Path
) -> None:
    assert (token_dtype(65_536), token_dtype(65_537)) == ("uint16", "uint32")
    tokenizer_dir = _word_tokenizer(tmp_path / "tok", words)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"w{words - 1} w0 w{words // 2}", f"w7 w{words - 2}"]
    for i, text in enumerate(texts):
        (corpus / f"{i}.txt").write_text(text)
    out = tmp_path / "out"
    prepare(PrepareOptions(str(corpus), str(out), tokenizer_path=str(tokenizer_dir), workers=1))
    found, starts, found_dtype = _read_prepared(out)
    tokenizer = HFTokenizer(tokenizer_dir)
    expected = [t for text in texts for t in [*tokenizer.encode(text).tolist(), tokenizer.eos_id]]
    assert (found, starts, found_dtype) == (expected, [0, 4], dtype)
    assert max(found) == words + 1  # ids beyond 65535 survive in uint32
    index = read_index(out)
    assert index.data["tokenizer"]["sha256"] and index.data["tokenizer"]["path"].endswith(
        "tokenizer.json"
    )


def test_a_non_empty_out_is_refused_and_overwrite_replaces_prepared_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _mixed_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["prepare", str(corpus), str(out), "--workers", "1"]) == 2
    assert "expected an empty or new directory, found 1 entry" in capsys.readouterr().err
    # --overwrite replaces prepared data only, never a directory of other files
    assert main(["prepare", str(corpus), str(out), "--overwrite"]) == 2
    assert "replaces only a directory prepared by hp-train prepare" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert main(["prepare", str(corpus / "a.txt"), str(out), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "MB/s" in err and "ETA" in err and "1 documents" in err
    assert main(["prepare", str(corpus), str(out), "--overwrite", "--workers", "1"]) == 0
    assert read_index(out).documents == 303


def test_a_failed_prepare_leaves_no_out_and_no_scratch(tmp_path: Path) -> None:
    corpus = _mixed_corpus(tmp_path / "corpus")
    with (corpus / "z.jsonl").open("w") as handle:  # the last part fails, after the others
        handle.write('{"text": "ok"}\n{"text": "ok"}\nnot json\n')
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"z.jsonl:3: expected a JSON object"):
        prepare(PrepareOptions(str(corpus), str(out), workers=2, part_bytes=2_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_bad_input_names_the_file_line_and_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"prepare INPUT = '.*nothing\*.txt': expected a"):
        prepare(PrepareOptions(str(tmp_path / "nothing*.txt"), str(tmp_path / "out")))
    big = tmp_path / "big.jsonl"
    lines = [json.dumps({"text": f"line {i}"}) for i in range(200)]
    lines[150] = "{broken"
    big.write_text("\n".join(lines) + "\n")
    # cut in pieces: the line number still counts from the file's start
    with pytest.raises(ValueError, match=r"big.jsonl:151: expected a JSON object"):
        prepare(PrepareOptions(str(big), str(tmp_path / "out"), workers=1, part_bytes=500))
    lines[150] = json.dumps({"body": "x"})
    big.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError,
        match=r"big.jsonl:151: expected an object with a string field 'text' \(data.field\), found keys \['body'\]",
    ):
        prepare(PrepareOptions(str(big), str(tmp_path / "out"), workers=1, part_bytes=500))
    assert not (tmp_path / "out").exists()


def test_undecodable_text_is_counted_and_a_mostly_undecodable_file_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # a stray latin-1 name in a UTF-8 file: accepted, counted
    (corpus / "a.txt").write_bytes("naïve text by Jos".encode() + b"\xe9" + b" and more words" * 20)
    out = tmp_path / "out"
    summary = prepare(PrepareOptions(str(corpus), str(out), workers=1))
    assert summary.decode.total == 1 and read_index(out).data["undecodable_characters"] == 1
    assert "1 undecodable character(s)" in summary.line()
    with pytest.warns(
        UndecodableTextWarning, match=r"data.path: 1 undecodable character\(s\) .*a.txt \(1, "
    ):
        load_job_data(JobConfig().apply_overrides([f"data.path={corpus}"]), ByteTokenizer())
    latin = "Les élèves étaient déçus à côté de l'été. " * 10
    (corpus / "b.txt").write_bytes(latin.encode("latin-1"))
    share = latin.encode("latin-1").decode("utf-8", "replace").count("\ufffd") / len(latin)
    with pytest.raises(
        ValueError, match=rf"b.txt: {share:.2%} of its {len(latin):,} characters are not utf-8"
    ):
        prepare(PrepareOptions(str(corpus), str(tmp_path / "o2"), workers=1))
    with pytest.raises(ValueError, match=r"data.path: .*b.txt: .* are not utf-8"):
        list(read_documents(str(corpus)))  # the job's reading refuses it too
    replaced = prepare(PrepareOptions(str(corpus), str(tmp_path / "o3"), decode_errors="replace"))
    assert replaced.decode.total == 1 + round(share * len(latin)) and replaced.decode.files == 2
    as_latin = list(read_documents(str(corpus / "b.txt"), encoding="latin-1"))
    assert as_latin == [latin]


def test_a_saved_dataset_prepares_to_its_rows_in_order(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = [f"row {i}: " + "ü" * (i % 5) for i in range(40)]
    datasets.Dataset.from_dict({"id": list(range(40)), "body": texts}).save_to_disk(
        str(tmp_path / "ds")
    )
    out = tmp_path / "out"
    options = PrepareOptions(
        str(tmp_path / "ds"), str(out), field="body", workers=1, part_bytes=200
    )
    prepare(options)
    stream = [t for text in texts for t in [*text.encode("utf-8"), BYTE_EOS]]
    found, starts, _ = _read_prepared(out)
    assert found == stream and len(starts) == 40 and len(read_index(out).shards) > 1
    with pytest.raises(
        ValueError, match=r"expected a column 'text' \(data.field\), found \['id', 'body'\]"
    ):
        prepare(PrepareOptions(str(tmp_path / "ds"), str(tmp_path / "o2"), workers=1))

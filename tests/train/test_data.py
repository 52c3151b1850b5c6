"""Data: byte tokenizer, packing with document ids, sources, dp sharding and exact continuation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hyper_parallel.train.data import BatchSampler, find_files, pack, read_documents
from hyper_parallel.train.tokenizer import BYTE_EOS, ByteTokenizer


def test_byte_tokenizer_ids_are_utf8_bytes_and_eos_is_256() -> None:
    text = "héllo"
    assert ByteTokenizer().encode(text).tolist() == list(text.encode("utf-8"))
    assert (ByteTokenizer.eos_id, ByteTokenizer.vocab_size) == (256, 257)


def test_packing_joins_documents_with_eos_and_keeps_document_ids() -> None:
    docs = ["ab", "cde", "f"]
    samples = pack(docs, ByteTokenizer(), seq_len=4)
    stream = [97, 98, BYTE_EOS, 99, 100, 101, BYTE_EOS, 102, BYTE_EOS]  # by hand
    assert len(samples) == (len(stream) - 1) // 4
    tokens, targets, documents = samples.sample(0)
    assert tokens.tolist() == stream[0:4] and targets.tolist() == stream[1:5]
    # "ab" and its EOS are document 0, "cde" starts at the 4th token
    assert documents.tolist() == [0, 0, 0, 1]
    tokens, _, documents = samples.sample(1)
    assert tokens.tolist() == stream[4:8]
    assert documents.tolist() == [0, 0, 0, 1]  # renumbered from the sample's first document


def _sampler(n: int, dp_rank: int, dp: int, local: int, accumulation: int) -> BatchSampler:
    samples = pack(["x" * (n * 4)], ByteTokenizer(), seq_len=4)
    assert len(samples) == n
    return BatchSampler(
        samples, seed=3, dp_rank=dp_rank, dp=dp, local_batch=local, accumulation=accumulation
    )


@pytest.mark.parametrize(("dp", "local", "accumulation"), [(2, 2, 1), (4, 1, 2), (1, 3, 2)])
def test_every_sample_of_an_epoch_is_read_once_across_dp_ranks(
    dp: int, local: int, accumulation: int
) -> None:
    n = 24
    seen: list[int] = []
    for rank in range(dp):
        sampler = _sampler(n, rank, dp, local, accumulation)
        for _ in range(n // (dp * local * accumulation)):
            before = sampler.position
            batches = sampler.next_step()
            assert len(batches) == accumulation and all(b.tokens.shape[0] == local for b in batches)
            per_rank = local * accumulation
            seen += sampler.indices(before + rank * per_rank, per_rank)
    assert sorted(seen) == list(range(n))
    # the next epoch is another permutation of all samples
    first = _sampler(n, 0, 1, n, 1)
    assert first.indices(0, n) != first.indices(n, n)
    assert sorted(first.indices(n, n)) == list(range(n))


def test_a_sampler_continues_exactly_from_its_position() -> None:
    straight = _sampler(10, 1, 2, 2, 1)
    steps = [straight.next_step() for _ in range(7)]  # crosses epochs
    resumed = _sampler(10, 1, 2, 2, 1)
    resumed.position = 4 * 4  # four global batches of 4 consumed
    for expected in steps[4:]:
        (got,) = resumed.next_step()
        assert torch.equal(got.tokens, expected[0].tokens)


def test_sources_text_directory_glob_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta")
    (tmp_path / ".hidden").write_text("no")
    assert list(read_documents(str(tmp_path))) == ["alpha", "beta"]
    assert list(read_documents(str(tmp_path / "**" / "b.txt"))) == ["beta"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    assert list(read_documents(str(jsonl), field="body")) == ["one", "two"]
    with pytest.raises(
        ValueError, match=r"d.jsonl:1: expected an object with a string field 'text'"
    ):
        list(read_documents(str(jsonl)))


def test_a_path_that_matches_no_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data.path = '.*nothing\*.txt': expected a file"):
        find_files(str(tmp_path / "nothing*.txt"))


def test_the_builtin_corpus_needs_no_download() -> None:
    samples = pack(read_documents(""), ByteTokenizer(), seq_len=64)
    assert len(samples) > 10_000  # ~2 MB of the standard library's sources


def test_a_tokenizer_json_reads_through_tokenizers_with_its_eos(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hyper_parallel.train.tokenizer import build_tokenizer

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    made = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    made.pre_tokenizer = pre_tokenizers.Whitespace()
    made.save(str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer(str(tmp_path))  # the directory holding tokenizer.json
    assert tokenizer.encode("hello world hello").tolist() == [1, 2, 1]
    assert (tokenizer.eos_id, tokenizer.vocab_size) == (3, 4)
    samples = pack(["hello world", "world"], tokenizer, seq_len=2)
    assert samples.stream.tolist() == [1, 2, 3, 2, 3]

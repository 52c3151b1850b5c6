"""The Hugging Face ``datasets`` source: a ``save_to_disk`` directory reads as its rows' text.

Oracle: the documents' UTF-8 bytes, each followed by EOS, written out by hand.
Offline: the dataset is made in memory and written to the test's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.data import read_documents
from hyper_parallel.train.tokenizer import BYTE_EOS, ByteTokenizer
from hyper_parallel.train.trainer import load_samples

DOCUMENTS = ["first row", "zweite Zeile, ü", "3"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-cache")))
        import datasets as module  # type: ignore[import-untyped]

        yield module


def test_a_saved_dataset_trains_on_its_rows_text_tokenized(datasets: Any, tmp_path: Path) -> None:
    rows = datasets.Dataset.from_dict({"id": [7, 8, 9], "text": DOCUMENTS})
    rows.save_to_disk(str(tmp_path / "ds"))
    assert list(read_documents(str(tmp_path / "ds"))) == DOCUMENTS  # recognised as a dataset
    job = JobConfig().apply_overrides(
        [f"data.path={tmp_path / 'ds'}", "data.holdout=0", "training.seq_len=4"]
    )
    samples, _ = load_samples(job, ByteTokenizer())
    stream: list[int] = []
    owners: list[int] = []
    for number, text in enumerate(DOCUMENTS):
        ids = [*text.encode("utf-8"), BYTE_EOS]
        stream += ids
        owners += [number] * len(ids)
    assert len(samples) == (len(stream) - 1) // 4
    for index in range(len(samples)):
        tokens, targets, documents = samples.sample(index)
        window = slice(4 * index, 4 * index + 4)
        assert tokens.tolist() == stream[window], index
        assert targets.tolist() == stream[4 * index + 1 : 4 * index + 5], index
        first = owners[4 * index]
        assert documents.tolist() == [o - first for o in owners[window]], index


def test_a_dataset_dict_reads_its_train_split_and_the_named_field(
    datasets: Any, tmp_path: Path
) -> None:
    splits = datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"body": ["held out"]}),
            "train": datasets.Dataset.from_dict({"body": DOCUMENTS}),
        }
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    assert list(read_documents(str(tmp_path / "dd"), field="body")) == DOCUMENTS
    assert list(read_documents(str(tmp_path / "dd"), format="hf", field="body")) == DOCUMENTS
    with pytest.raises(
        ValueError,
        match=r"data.path = '.*dd': expected a column 'text' \(data.field\), found \['body'\]",
    ):
        list(read_documents(str(tmp_path / "dd")))

"""The LR schedule: warmup, then decay over its own decay_steps; never a function of training.steps."""

from __future__ import annotations

import itertools
import math

import pytest

from hyper_parallel.train.config import LRSchedulerConfig
from hyper_parallel.train.lr import lr_at


def test_warmup_then_constant_without_decay_steps() -> None:
    cfg = LRSchedulerConfig(warmup_steps=4)
    assert [lr_at(s, 2.0, cfg) for s in range(1, 8)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_decay_reaches_the_minimum_after_decay_steps_and_stays(decay: str) -> None:
    cfg = LRSchedulerConfig(warmup_steps=2, decay_steps=10, decay=decay, min_lr_ratio=0.1)  # type: ignore[arg-type]
    rates = [lr_at(s, 1.0, cfg) for s in range(1, 20)]
    assert rates[1] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(rates[1:]))  # non-increasing after warmup
    assert rates[11:] == [pytest.approx(0.1)] * 8


def test_cosine_and_wsd_against_their_formulas() -> None:
    cos = LRSchedulerConfig(warmup_steps=0, decay_steps=8, decay="cosine")
    assert lr_at(4, 1.0, cos) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    wsd = LRSchedulerConfig(warmup_steps=0, decay_steps=10, decay="wsd", wsd_decay_ratio=0.2)
    assert [lr_at(s, 1.0, wsd) for s in (1, 8, 9, 10)] == pytest.approx([1.0, 1.0, 0.5, 0.0])

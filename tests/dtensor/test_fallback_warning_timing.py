"""The gather fallback's "Correct, but it communicates" warning comes only once the fallback ran.

An op that torch itself rejects (``mean`` of an integer tensor: "could not infer output
dtype") must surface torch's error alone, as on a plain tensor, with no fallback warning
and no fallback counted; an op that does run through the fallback (``multinomial`` of
class shards) still warns once and is counted. Oracle: the same calls on plain tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from tests._harness import run_on_ranks

import hyper_parallel.dtensor as hp


def _calls() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = hp.init_device_mesh("cpu", (2,))
    out: dict[str, Any] = {}
    ints = hp.distribute_tensor(torch.arange(8), mesh, [hp.Shard(0)])
    probs = hp.distribute_tensor(torch.full((4, 6), 1 / 6), mesh, [hp.Shard(1)])
    calls: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("mean of ints", lambda: ints.mean()),
        ("multinomial of class shards", lambda: torch.multinomial(probs, 2)),
    )
    with hp.strict_mode(False):
        for name, call in calls:
            hp.reset_fallback_counts()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    call()
                    out[f"{name} error"] = None
                except RuntimeError as error:
                    out[f"{name} error"] = str(error)
            out[f"{name} warnings"] = [
                type(w.message).__name__ for w in caught if "full tensors" in str(w.message)
            ]
            out[f"{name} fallbacks"] = dict(hp.fallback_counts())
    return out


def test_fallback_warns_only_when_it_ran() -> None:
    try:
        torch.arange(8).mean()
        plain_error = None
    except RuntimeError as error:
        plain_error = str(error)
    assert plain_error is not None
    for rank, got in enumerate(run_on_ranks(_calls, 2, timeout_s=240)):
        assert got["mean of ints error"] == plain_error, rank
        assert got["mean of ints warnings"] == [], rank
        assert got["mean of ints fallbacks"] == {}, rank
        assert got["multinomial of class shards error"] is None, rank
        assert got["multinomial of class shards warnings"] == ["FallbackWarning"], rank
        assert got["multinomial of class shards fallbacks"] == {"aten.multinomial.default": 1}

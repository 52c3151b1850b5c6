"""hp's fully_shard trains as one process on the global batch, and as torch's FSDP2.

Oracles: the same model and two AdamW steps in one process on the global batch
(:func:`tests.dtensor._fsdp_cases.one_process`), and torch's own ``fully_shard`` on
the same ranks, model, mesh and batches: losses, gradients, parameters, local shards,
placements and the collectives each side's CommDebugMode counts.
"""

from __future__ import annotations

from typing import Any

import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from tests.dtensor import _fsdp_cases as cases
from tests.dtensor._tp_examples import HP, TORCH

# 1-D FSDP over 4 (uneven dims: 10 and 3 rows), HSDP (replicate 2, shard 2), FSDP x TP.
MODES: dict[str, tuple[int, ...]] = {"fsdp": (4,), "hsdp": (2, 2), "fsdp_tp": (2, 2)}

# Where FSDP and TP shard the same dim both sides write (_StridedShard(dim=0, sf=2),
# Shard(dim=0)) on (dp, tp), with the same local shard on every rank (checked below).


def _train_all_modes(modes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"one": cases.one_process()}
    for mode, shape in modes.items():
        for api in (HP, TORCH):
            out[f"{mode}/{api.name}"] = cases.train(api, shape, mode)
    return out


def _check_against_one_process(run: dict[str, Any], one: dict[str, Any], what: str) -> None:
    for step in range(cases.STEPS):
        assert abs(run["loss"][step] - one["loss"][step]) <= 1e-5 * abs(one["loss"][step]), what
        for n, g in one["grads"][step].items():
            assert_close_to_scale(run["grads"][step][n], g, what=f"{what} step {step} grad {n}")
    for n, p in one["params"].items():
        assert_close_to_scale(run["params"][n], p, what=f"{what} param {n}")


def test_fsdp_hsdp_and_fsdp_tp_train_as_one_process_and_as_torch_on_four_ranks() -> None:
    for rank, got in enumerate(run_on_ranks(_train_all_modes, 4, MODES, timeout_s=300)):
        for mode in MODES:
            hp, tt = got[f"{mode}/hp"], got[f"{mode}/torch"]
            what = f"rank {rank} {mode}"
            _check_against_one_process(hp, got["one"], f"{what} hp")
            _check_against_one_process(tt, got["one"], f"{what} torch")
            assert hp["counts"] == tt["counts"], (what, hp["counts"], tt["counts"])
            for n, want in tt["layouts"].items():
                assert hp["layouts"][n] == want, (what, n, hp["layouts"][n], want)
                assert_close_to_scale(hp["locals"][n], tt["locals"][n], what=f"{what} shard {n}")
        # one all-gather per group and unshard, one reduce-scatter per group: 3 groups
        assert got["fsdp/hp"]["counts"] == {"all_gather": 5, "reduce_scatter": 3}
        assert got["hsdp/hp"]["counts"] == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}

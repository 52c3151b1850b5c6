"""Pipeline parallelism on torch's schedules equals one process on the full batch.

Each launch runs several schedules on real gloo ranks and records, per rank, the
initial values, every step's loss, gradients and parameters (full tensors). The oracle
is computed here, in one process: the same Llama built and initialised after the same
``torch.manual_seed``, trained with AdamW on the full batch. Initial values must be
bitwise equal; losses and gradients equal to scale (microbatches sum the same terms in
another order); parameters are compared after each AdamW step given identical
gradients (the oracle steps with the pipeline's gradients, so that Adam's division by
small second moments cannot amplify rounding into a spurious mismatch).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests._harness import run_on_ranks
from tests._tolerance import assert_close_to_scale
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hyper_parallel.dmodule import BaseModel
from hyper_parallel.dmodule.checkpoint import (
    CheckpointMismatchError,
    ModelState,
    load,
    save,
    step_path,
)
from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.training import synthetic_batch
from hyper_parallel.dmodule.pipeline import Pipeline, pipeline
from hyper_parallel.dtensor import DeviceMesh, DTensor, init_device_mesh
from hyper_parallel.dtensor.collectives import CollectiveRecord, observe_collectives
from hyper_parallel.dtensor.fsdp import FSDPModule

TIMEOUT_S = 400.0
CONFIG = Llama.Config(
    vocab_size=64, dim=32, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=64, max_seq_len=16
)
BATCH, SEQ, MICROBATCHES, STEPS, LR, SEED = 8, 16, 4, 3, 1e-2, 0

Record = dict[str, Any]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _named(pipe: Pipeline) -> dict[str, torch.nn.Parameter]:
    return {name: p for part in pipe.model_parts for name, p in part.named_parameters()}


def _train(pipe: Pipeline, steps: int = STEPS, dp: DeviceMesh | None = None) -> Record:
    """Initialise and train ``pipe``; what one rank saw, as full tensors.

    With ``dp`` (a ``dp_shard`` mesh) each dp rank feeds its rows of the batch, the
    loss is the dp ranks' mean, and the step's collectives are recorded.
    """
    torch.manual_seed(SEED)
    pipe.init_weights()
    params = _named(pipe)
    record: Record = {
        "stages": pipe.stage_indices,
        "init": {n: _full(p) for n, p in params.items()},
        "generator_after_init": torch.get_rng_state(),
        "losses": [],
        "grads": [],
        "params": [],
        "reduce_scatters": [],
    }
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR)
    for step in range(steps):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=64)
        optimizer.zero_grad()
        if dp is None:
            loss = pipe.step(tokens, target=targets)
        else:
            rows = BATCH // dp.size(0)
            begin = dp.get_local_rank(0) * rows
            seen: list[CollectiveRecord] = []
            with observe_collectives(seen.append):
                loss = pipe.step(tokens[begin : begin + rows], target=targets[begin : begin + rows])
            record["reduce_scatters"].append(
                sum(r.kind == "reduce_scatter" and r.mesh_axis == "dp_shard" for r in seen)
            )
            if loss is not None:
                torch.distributed.all_reduce(loss, group=dp.get_group(0))
                loss = loss / dp.size(0)
        record["losses"].append(None if loss is None else float(loss))
        record["grads"].append({n: _full(p.grad) for n, p in params.items() if p.grad is not None})
        optimizer.step()
        record["params"].append({n: _full(p) for n, p in params.items()})
    return record


def _build(mesh: DeviceMesh, schedule: str, stages_per_rank: int = 1, **config: Any) -> Pipeline:
    with torch.device("meta"):
        model = CONFIG.replace(**config).build()
    return pipeline(
        model,
        mesh,
        schedule=schedule,
        n_microbatches=MICROBATCHES,
        loss_fn=cross_entropy,
        stages_per_rank=stages_per_rank,
    )


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class Unsplittable(BaseModel):
    """A model no ModelSpec describes: nothing says where it may be cut."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        dim: int = 4
        param_init = {"weight": torch.nn.init.ones_}  # noqa: RUF012 - a Config field

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(config.dim, config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _bad_inputs(mesh: DeviceMesh, tp_only: DeviceMesh) -> dict[str, str]:
    """Every refused argument's message; the model must come out untouched."""
    with torch.device("meta"):
        model = CONFIG.build()
    before = {n: id(p) for n, p in model.named_parameters()}

    def build(**kwargs: Any) -> Callable[[], object]:
        args: dict[str, Any] = {
            "schedule": "1F1B",
            "n_microbatches": MICROBATCHES,
            "loss_fn": cross_entropy,
            **kwargs,
        }
        target = args.pop("model", model)
        on = args.pop("mesh", mesh)
        return lambda: pipeline(target, on, **args)

    errors = {
        "more_stages_than_layers": build(schedule="Interleaved1F1B", stages_per_rank=3),
        "split_not_increasing": build(split=[0, 0]),
        "split_out_of_range": build(split=[0, 4]),
        "split_not_from_zero": build(split=[1, 2]),
        "split_wrong_length": build(split=[0, 1, 2]),
        "too_few_microbatches": build(n_microbatches=1),
        "no_pp_axis": build(mesh=tp_only),
        "stages_per_rank_single_schedule": build(schedule="GPipe", stages_per_rank=2),
        "v_schedule_needs_two": build(schedule="ZBVZeroBubble", stages_per_rank=1),
        "unknown_schedule": build(schedule="OneFOneB"),
        "no_split_declared": build(model=Unsplittable.Config().build()),
    }
    out = {name: _error(call) for name, call in errors.items()}
    after = {n: id(p) for n, p in model.named_parameters()}
    untouched = (
        before == after
        and all(p.is_meta for p in model.parameters())
        and not any(getattr(m, "is_parallelized", False) for m in model.modules())
    )
    out["model_untouched"] = str(untouched)
    pipe = _build(mesh, "GPipe")
    tokens, targets = synthetic_batch(0, batch_size=6, seq_len=SEQ, vocab_size=64)
    out["batch_not_divisible"] = _error(lambda: pipe.step(tokens, target=targets))
    return out


PP_DP_SCHEDULES = ("1F1B", "GPipe")
PP2_SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)]


def _resume_stages(mesh: DeviceMesh, directory: str) -> dict[str, Any]:
    """hp's ``load`` resumes each stage from a checkpoint of all stages; a real mismatch is named."""
    saved_pipe = _build(mesh, "GPipe")
    torch.manual_seed(SEED)
    saved_pipe.init_weights()
    (saved_part,) = saved_pipe.model_parts
    save({"app": ModelState(saved_part)}, directory, step=0)
    resumed = _build(mesh, "GPipe")
    torch.manual_seed(SEED + 1)  # other values, overwritten by the load
    resumed.init_weights()
    (part,) = resumed.model_parts
    out: dict[str, Any] = {
        "saved": {k: _full(v) for k, v in saved_part.state_dict().items()},
        "step": load({"app": ModelState(part)}, directory),
        "loaded": {k: _full(v) for k, v in part.state_dict().items()},
    }
    wrong = _build(mesh, "GPipe")
    wrong.init_weights()
    (wrong_part,) = wrong.model_parts
    if wrong.has_last_stage:  # no rank holds the checkpoint's norm keys any more
        wrong_part.norm = torch.nn.Identity()
    try:
        load({"app": ModelState(wrong_part)}, directory)
        out["mismatch"] = "no error"
    except CheckpointMismatchError as error:
        out["mismatch"] = {"unexpected": error.unexpected, "missing": error.missing}
    except ValueError as error:
        out["mismatch"] = str(error)
    return out


def _pp2(directory: str) -> dict[str, Any]:
    """pp=2: the bad inputs, each schedule of PP2_SCHEDULES trained, stages resumed by ``load``."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    tp_only = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {"bad": _bad_inputs(mesh, tp_only)}
    for schedule, per_rank in PP2_SCHEDULES:
        try:
            out[schedule] = _train(_build(mesh, schedule, per_rank))
        except Exception:
            out[schedule] = traceback.format_exc()
    try:
        out["resume"] = _resume_stages(mesh, directory)
    except Exception:
        out["resume"] = traceback.format_exc()
    return out


def _pp2_tp2(directory: str) -> dict[str, Any]:
    """pp=2 x tp=2: 1F1B trained and checkpointed; sequence parallel; the checkpoint elsewhere."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pipe = _build(mesh, "1F1B")
    out: dict[str, Any] = {"1F1B": _train(pipe)}
    (part,) = pipe.model_parts
    save({"app": ModelState(part)}, directory, step=STEPS)
    out["saved"] = {k: _full(v) for k, v in part.state_dict().items()}
    out["sequence_parallel"] = _train(_build(mesh, "1F1B", sequence_parallel=True), steps=1)

    # pp=2 x dp_shard=2: each stage fully sharded over its dp pair, the batch split over it
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    for schedule in PP_DP_SCHEDULES:
        try:
            staged_dp = _build(pp_dp, schedule)
            (dp_part,) = staged_dp.model_parts
            record = _train(staged_dp, dp=pp_dp["dp_shard"])
            record["fsdp_root"] = isinstance(dp_part, FSDPModule)
            out[f"dp_{schedule}"] = record
        except Exception:
            out[f"dp_{schedule}"] = traceback.format_exc()

    # the same checkpoint on tp=4 without pipelining, into a model of other values
    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = CONFIG.build()
    model.parallelize(tp4).to_empty(device="cpu")
    torch.manual_seed(SEED + 1)
    model.init_weights()
    load({"app": ModelState(model)}, directory, step=STEPS)
    out["tp4"] = {k: _full(v) for k, v in model.state_dict().items()}
    # ... and on pp=4 (one layer per stage): each stage reads its own keys (DCP's engine)
    pp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    staged = _build(pp4, "GPipe")
    torch.manual_seed(SEED + 1)
    staged.init_weights()
    (stage,) = staged.model_parts
    dcp_load({"app": {"model": stage.state_dict()}}, checkpoint_id=str(step_path(directory, STEPS)))
    out["pp4"] = {k: _full(v) for k, v in stage.state_dict().items()}
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # one process, no process group: DCP alone
        plain = CONFIG.build()
        state = {"app": {"model": plain.state_dict()}}
        dcp_load(state, checkpoint_id=str(step_path(directory, STEPS)), no_dist=True)
        out["one_process"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


# -- the oracle: one process, full batch ---------------------------------------------


def _check_against_one_process(records: list[Record], *, steps: int = STEPS, **config: Any) -> None:
    """Every rank's record equals one process's run of the same config, seed and batches."""
    for record in records:
        assert isinstance(record, dict), record  # a traceback string when the rank failed
    reference = CONFIG.replace(**config).build()
    torch.manual_seed(SEED)
    reference.init_weights()
    generator_after_init = torch.get_rng_state()
    params = dict(reference.named_parameters())
    held = sorted({name for r in records for name in r["init"]})
    assert held == sorted(params), "the stages together hold every parameter once"
    for record in records:
        assert torch.equal(record["generator_after_init"], generator_after_init)
        for name, value in record["init"].items():
            assert torch.equal(value, params[name].detach()), f"init of {name} differs"
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR)
    for step in range(steps):
        tokens, targets = synthetic_batch(step, batch_size=BATCH, seq_len=SEQ, vocab_size=64)
        optimizer.zero_grad()
        loss = reference.loss(tokens, targets)
        loss.backward()
        losses = [r["losses"][step] for r in records if r["losses"][step] is not None]
        assert losses, "some rank holds the last stage and returns the loss"
        for got in losses:
            assert_close_to_scale(torch.tensor(got), loss.detach(), rel=1e-5, what=f"loss {step}")
        pipeline_grads: dict[str, torch.Tensor] = {}
        for record in records:
            for name, grad in record["grads"][step].items():
                assert_close_to_scale(grad, params[name].grad, rel=1e-4, what=f"grad {name}")
                pipeline_grads[name] = grad
        assert sorted(pipeline_grads) == held
        with torch.no_grad():
            for name, grad in pipeline_grads.items():  # given identical gradients
                params[name].grad.copy_(grad)
        optimizer.step()
        for record in records:
            for name, value in record["params"][step].items():
                assert_close_to_scale(value, params[name].detach(), rel=1e-5, what=name)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("pp2") / "ckpt")
    return run_on_ranks(_pp2, 2, directory, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("pp2_tp2") / "ckpt")
    return run_on_ranks(_pp2_tp2, 4, directory, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("schedule", "stages_per_rank"), PP2_SCHEDULES)
def test_pp2_schedule_trains_as_one_process(
    pp2: list[dict[str, Any]], schedule: str, stages_per_rank: int
) -> None:
    records = [rank[schedule] for rank in pp2]
    _check_against_one_process(records)
    held = [r["stages"] for r in records]
    assert all(len(stages) == stages_per_rank for stages in held)
    assert sorted(s for stages in held for s in stages) == list(range(2 * stages_per_rank))


def test_load_resumes_each_pipeline_stage_and_still_names_keys_no_rank_holds(
    pp2: list[dict[str, Any]],
) -> None:
    results = [rank["resume"] for rank in pp2]
    for result in results:
        assert isinstance(result, dict), result  # a traceback string when the rank failed
        assert result["step"] == 0
        assert sorted(result["loaded"]) == sorted(result["saved"])
        for key, value in result["saved"].items():
            assert torch.equal(result["loaded"][key], value), key
    held = sorted(k for result in results for k in result["saved"])
    assert held == sorted(CONFIG.build().state_dict()), "each stage resumed only its own keys"
    # the last stage lost its norm: no rank holds the checkpoint's norm keys, and every rank
    # (the one holding no norm anyway too) refuses naming them, before loading anything
    for result in results:
        assert result["mismatch"] == {"unexpected": ["app.model.norm.weight"], "missing": []}


def test_pp2_tp2_1f1b_trains_as_one_process(pp2_tp2: list[dict[str, Any]]) -> None:
    _check_against_one_process([rank["1F1B"] for rank in pp2_tp2])


@pytest.mark.parametrize("schedule", PP_DP_SCHEDULES)
def test_pp2_dp_shard2_trains_as_one_process_reducing_once_per_step(
    pp2_tp2: list[dict[str, Any]], schedule: str
) -> None:
    records = [rank[f"dp_{schedule}"] for rank in pp2_tp2]
    _check_against_one_process(records)
    for record in records:
        assert record["fsdp_root"], "parallelize_llama fully shards each stage over dp_shard"
        # the gradient sync deferred to the last microbatch: one reduce-scatter per FSDP
        # unit holding parameters per step (the first stage: the embeddings and 2 blocks;
        # the last: 2 blocks, then the norm and the output together), not one per
        # microbatch (MICROBATCHES times as many)
        assert record["reduce_scatters"] == [3] * STEPS, record["reduce_scatters"]


def test_pp2_tp2_sequence_parallel_activations_cross_stages(pp2_tp2: list[dict[str, Any]]) -> None:
    records = [rank["sequence_parallel"] for rank in pp2_tp2]
    _check_against_one_process(records, steps=1, sequence_parallel=True)


def test_checkpoint_saved_on_pp2_tp2_loads_on_tp4_pp4_and_one_process(
    pp2_tp2: list[dict[str, Any]],
) -> None:
    saved: dict[str, torch.Tensor] = {}
    for rank in pp2_tp2:
        saved.update(rank["saved"])
    assert sorted(saved) == sorted(CONFIG.build().state_dict())
    for loaded in [*(rank["tp4"] for rank in pp2_tp2), pp2_tp2[0]["one_process"]]:
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
    on_pp4: dict[str, torch.Tensor] = {}
    for rank in pp2_tp2:
        on_pp4.update(rank["pp4"])
        for key, value in rank["pp4"].items():
            assert torch.equal(value, saved[key]), key
    assert sorted(on_pp4) == sorted(saved)


BAD_INPUT_MESSAGES = {
    "more_stages_than_layers": ("6 stages", "has 4"),
    "split_not_increasing": ("strictly increasing", "[0, 0]"),
    "split_out_of_range": ("[0, 4)", "[0, 4]"),
    "split_not_from_zero": ("start at layer 0", "[1, 2]"),
    "split_wrong_length": ("one start per stage (2)", "found 3"),
    "too_few_microbatches": ("at least as many microbatches as stages (2)", "n_microbatches=1"),
    "no_pp_axis": ("'pp' axis", "('tp',)"),
    "stages_per_rank_single_schedule": ("one stage per rank", "stages_per_rank=2"),
    "v_schedule_needs_two": ("exactly 2 stages per rank", "stages_per_rank=1"),
    "unknown_schedule": ("expected one of", "'OneFOneB'"),
    "no_split_declared": ("declare how to cut it", "no registered ModelSpec"),
    "batch_not_divisible": ("batch of 6", "n_microbatches=4"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT_MESSAGES))
def test_bad_input_is_refused_naming_expected_and_found(
    pp2: list[dict[str, Any]], case: str
) -> None:
    for rank in pp2:
        message = rank["bad"][case]
        assert message.startswith(("ValueError", "TypeError")), message
        for part in BAD_INPUT_MESSAGES[case]:
            assert part in message, (case, message)


def test_refused_calls_leave_the_model_untouched(pp2: list[dict[str, Any]]) -> None:
    assert all(rank["bad"]["model_untouched"] == "True" for rank in pp2)

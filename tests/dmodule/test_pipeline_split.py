"""Cutting a declarative model into pipeline stages, in one process (no schedule runs).

Oracles: the full model's own state names and forward (the stages together hold each
state once, under its original FQN, and chained they compute the full model's logits),
and torch's own stage placement (``generate_stage_to_rank_mapping``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from hyper_parallel.dmodule import MeshAxisName, ModelSpec
from hyper_parallel.dmodule.models.llama import (
    LLAMA_PIPELINE_SPLIT,
    LLAMA_SPEC,
    Llama,
    pipeline_llama,
)
from hyper_parallel.dmodule.pipeline import (
    PassThrough,
    PipelineSplit,
    StageLayers,
    build_stage,
    even_starts,
    microbatch_weights,
    plan_stages,
    stage_owner,
)
from hyper_parallel.dtensor import Replicate, Shard

CONFIG = Llama.Config(vocab_size=32, dim=16, n_layers=5, n_heads=2, ffn_dim=32, max_seq_len=8)


def test_even_split_gives_earlier_stages_the_extra_layers() -> None:
    assert even_starts(5, 2) == [0, 3]
    assert even_starts(8, 4) == [0, 2, 4, 6]
    assert even_starts(7, 3) == [0, 3, 5]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_stages_hold_every_state_once_under_its_original_fqn(num_stages: int) -> None:
    with torch.device("meta"):
        model = CONFIG.build()
    plans = plan_stages(model, LLAMA_PIPELINE_SPLIT, num_stages)
    stages = [build_stage(model, LLAMA_PIPELINE_SPLIT, plan) for plan in plans]
    names = [n for stage in stages for n in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())
    assert len(names) == len(set(names))
    assert "tok_embeddings.weight" in stages[0].state_dict()
    assert {"norm.weight", "output.weight"} <= set(stages[-1].state_dict())
    for plan, stage in zip(plans, stages, strict=True):
        assert isinstance(stage, Llama)
        layers = stage.layers
        assert isinstance(layers, StageLayers)
        assert layers.indices() == list(range(plan.start, plan.stop))
        assert layers[plan.start] is next(iter(layers))
    assert all(p.is_meta for p in model.parameters()), "the model itself is left as it was"
    assert len(model.layers) == CONFIG.n_layers


def test_chained_stages_compute_the_full_models_logits() -> None:
    model = CONFIG.build()
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    plans = plan_stages(model, LLAMA_PIPELINE_SPLIT, 3, [0, 1, 4])
    h: torch.Tensor = tokens
    for plan in plans:
        h = build_stage(model, LLAMA_PIPELINE_SPLIT, plan)(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_chained_stages_given_document_ids_compute_the_packed_models_logits() -> None:
    model = CONFIG.build()
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])
    h: torch.Tensor = tokens
    for plan in plan_stages(model, LLAMA_PIPELINE_SPLIT, 2):
        h = build_stage(model, LLAMA_PIPELINE_SPLIT, plan)(h, document_ids=docs)
    torch.testing.assert_close(h, model(tokens, document_ids=docs), rtol=0, atol=0)
    assert not torch.equal(h, model(tokens)), "the documents change the logits"


def test_microbatch_weights_make_the_mean_of_microbatch_means_the_batch_mean() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 5)
    targets = torch.randint(0, 5, (4, 6))
    targets[0, :4] = -100
    targets[3, 2] = -100
    micro_targets = list(targets.tensor_split(2))
    weights = microbatch_weights(micro_targets)
    assert weights is not None
    means = [
        F.cross_entropy(chunk.flatten(0, 1), t.flatten())
        for chunk, t in zip(logits.tensor_split(2), micro_targets, strict=True)
    ]
    weighted = torch.stack([m * w for m, w in zip(means, weights, strict=True)]).mean()
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(weighted, whole)
    assert microbatch_weights(list(torch.ones(4, 6).long().tensor_split(2))) is None


def test_a_stage_stands_in_pass_throughs_for_other_stages_parts() -> None:
    with torch.device("meta"):
        model = CONFIG.build()
    middle = build_stage(
        model, LLAMA_PIPELINE_SPLIT, plan_stages(model, LLAMA_PIPELINE_SPLIT, 3)[1]
    )
    assert isinstance(middle, Llama)
    for name in ("tok_embeddings", "norm", "output"):
        assert isinstance(getattr(middle, name), PassThrough)
    with pytest.raises(IndexError, match=r"holds layers \[2, 3\], not 0"):
        middle.layers[0]


@pytest.mark.parametrize(
    ("schedule", "style"), [("Interleaved1F1B", "loop"), ("ZBVZeroBubble", "v")]
)
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_owner_places_stages_as_torchs_schedules_do(
    schedule: str, style: str, pp: int
) -> None:
    expected = generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
    assert {s: stage_owner(s, pp, schedule) for s in range(2 * pp)} == expected


def test_llama_ref_spec_declares_its_split_and_pipelining_fn() -> None:
    assert LLAMA_SPEC.pipeline_split is LLAMA_PIPELINE_SPLIT
    assert LLAMA_SPEC.pipelining_fn is not None
    layout = LLAMA_PIPELINE_SPLIT.activation_layout
    assert layout(CONFIG) == {MeshAxisName.TP: Replicate()}
    assert layout(CONFIG.replace(sequence_parallel=True)) == {MeshAxisName.TP: Shard(1)}


def test_split_problems_name_expected_and_found() -> None:
    with torch.device("meta"):
        model = CONFIG.build()
    cases = [
        (PipelineSplit(layers="blocks"), 2, None, r"names \['blocks'\], which are not children"),
        (PipelineSplit(layers="norm"), 2, None, "expected a ModuleList of blocks"),
        (
            PipelineSplit(first=("output",), last=("tok_embeddings",)),
            2,
            None,
            "expected first=\\('output',\\) before 'layers'",
        ),
        (PipelineSplit(first=("tok_embeddings",)), 2, None, r"children \['norm', 'output'\] hold"),
        (LLAMA_PIPELINE_SPLIT, 6, None, "6 stages need at least 6 layers"),
        (LLAMA_PIPELINE_SPLIT, 2, [0, 5], r"expected starts in \[0, 5\)"),
        (LLAMA_PIPELINE_SPLIT, 2, [0, 2.5], "expected int layer indices"),
    ]
    for split, stages, starts, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            plan_stages(model, split, stages, starts)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="each child is named once"):
        PipelineSplit(first=("layers",))
    with pytest.raises(TypeError, match="pipeline_split: expected a PipelineSplit"):
        ModelSpec(name="x", model=CONFIG, pipeline_split="layers")  # type: ignore[arg-type]


def test_llama_pipelining_fn_refuses_unknown_options() -> None:
    with torch.device("meta"):
        model = CONFIG.build()
    with pytest.raises(ValueError, match=r"names \['microbatches'\]; expected schedule"):
        pipeline_llama(model, None, {"pipeline": {"microbatches": 4}})  # type: ignore[arg-type]

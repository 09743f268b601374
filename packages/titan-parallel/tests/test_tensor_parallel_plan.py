"""A model's TP plan is resolved against the modules present: wildcards expand, absent keys drop."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel
from toy_transformer import ToyTransformer

from titan_parallel import ModelDescriptionError, blocks_of
from titan_parallel.pipeline_split import stage_module
from titan_parallel.tensor_parallel import resolve_plan, tp_plan_of


def test_wildcards_expand_to_every_block():
    model = ToyTransformer(n_layers=3)
    plan = resolve_plan(model, tp_plan_of(model, sequence_parallel=True, loss_parallel=True))
    assert {k for k in plan if k.endswith(".wq")} == {
        "layers.0.attention.wq",
        "layers.1.attention.wq",
        "layers.2.attention.wq",
    }
    assert "norm" in plan and "layers.2.ffn_norm" in plan


def test_keys_for_modules_a_pipeline_stage_dropped_are_skipped():
    model = ToyTransformer(n_layers=3)
    units = model.pipeline_units()
    stage = stage_module(model, ["layers.2", "norm", "output"], units)
    plan = resolve_plan(stage, tp_plan_of(stage, sequence_parallel=True, loss_parallel=True))
    assert "tok_embeddings" not in plan and "output" in plan
    assert not any(k.startswith(("layers.0", "layers.1")) for k in plan)


def test_without_sequence_parallel_norms_are_not_split():
    model = ToyTransformer()
    plan = resolve_plan(model, tp_plan_of(model, sequence_parallel=False, loss_parallel=False))
    assert not any(k.endswith("norm") for k in plan)


def test_a_pattern_matches_whole_name_segments_only():
    model = ToyTransformer(n_layers=2)
    assert list(resolve_plan(model, {"layers.*.attention.w": ColwiseParallel()})) == []


def test_models_that_do_not_describe_themselves_are_refused_with_the_method_to_add():
    with pytest.raises(ModelDescriptionError, match="give it a tp_plan"):
        tp_plan_of(torch.nn.Linear(2, 2), sequence_parallel=True, loss_parallel=True)
    with pytest.raises(ModelDescriptionError, match="give it a parallel_blocks"):
        blocks_of(torch.nn.Linear(2, 2))

"""Cutting a model into pipeline stages, checked in one process: which units each stage keeps."""

import pytest
import torch
from toy_transformer import SEQ, VOCAB, ToyTransformer

from titan_parallel import ModelDescriptionError, ParallelConfigError, PipelineOptions
from titan_parallel.pipeline import stage_ids_of_rank, stages_per_rank
from titan_parallel.pipeline_split import pipeline_units_of, split_units, stage_module

UNITS = ["tok_embeddings", *[f"layers.{i}" for i in range(6)], "norm", "output"]
BLOCKS = [f"layers.{i}" for i in range(6)]


def test_even_split_puts_embedding_first_head_last_and_extra_layers_in_the_middle():
    stages = split_units(UNITS, BLOCKS, 4)
    assert stages == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]


def test_embedding_and_output_count_as_layers_as_torchtitan_counts_them():
    # 6 layers + embedding + output over 8 stages: one unit each, the embedding and the head alone.
    assert split_units(UNITS, BLOCKS, 8) == [["tok_embeddings"], *[[b] for b in BLOCKS], ["norm", "output"]]
    # pp 2 with pipeline_parallel_layers_per_stage 4: ceil(8 / 4) = 2 stages of 4 weighted layers.
    assert split_units(UNITS, BLOCKS, 2) == [UNITS[:4], UNITS[4:]]
    # 8 units over 3 stages: 3, 3, 2 weighted layers; the first stages take the extra ones.
    assert split_units(UNITS, BLOCKS, 3) == [UNITS[:3], UNITS[3:6], UNITS[6:]]
    # Heavier embedding and head (pipeline_parallel_first/last_stage_less_layers = 2).
    stages = split_units(UNITS, BLOCKS, 2, first_stage_less_layers=2, last_stage_less_layers=2)
    assert stages == [UNITS[:4], UNITS[4:]]
    assert split_units(UNITS, BLOCKS, 2, first_stage_less_layers=0, last_stage_less_layers=2) == [
        UNITS[:5],
        UNITS[5:],
    ]


def test_split_points_decide_where_stages_begin():
    stages = split_units(UNITS, BLOCKS, 2, split_points=["layers.4"])
    assert stages == [UNITS[:5], UNITS[5:]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_stages": 9}, "9 pipeline stages but the model has only 8 layers counting the embedding"),
        (
            {"num_stages": 4, "first_stage_less_layers": 3},
            r"first_stage_less_layers \(3\) exceeds the 2 layers",
        ),
        ({"num_stages": 2, "split_points": ["layers.9"]}, r"\['layers.9'\] are not pipeline units"),
        ({"num_stages": 3, "split_points": ["layers.4", "layers.2"]}, "distinct units in forward order"),
        ({"num_stages": 4, "split_points": ["layers.2"]}, "make 2 stages, but the schedule needs 4"),
    ],
)
def test_impossible_splits_are_refused_with_the_numbers(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        split_units(UNITS, BLOCKS, **kwargs)


def test_stages_run_in_sequence_compute_the_whole_model():
    torch.manual_seed(0)
    model = ToyTransformer(n_layers=3)
    units = pipeline_units_of(model)
    cut = split_units(units, list(model.parallel_blocks()), 2)
    stages = [stage_module(model, keep, units) for keep in cut]
    assert stages[0].norm is None and stages[0].output is None and list(stages[0].layers) == ["0", "1"]
    assert stages[1].tok_embeddings is None and list(stages[1].layers) == ["2"]
    # Parameter names are those of the whole model, so a checkpoint loads into any layout.
    whole = dict(model.named_parameters())
    assert all(name in whole for stage in stages for name, _ in stage.named_parameters())
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens), rtol=0, atol=0)


def test_stage_pruning_deletes_from_module_lists_too():
    class ListModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    model = ListModel()
    units = ["layers.0", "layers.1", "layers.2", "layers.3"]
    stage = stage_module(model, ["layers.1", "layers.2"], units)
    assert len(stage.layers) == 2
    assert torch.equal(stage.layers[0].weight, model.layers[1].weight)


def test_a_model_without_pipeline_units_is_refused():
    with pytest.raises(ModelDescriptionError, match="give it a pipeline_units"):
        pipeline_units_of(torch.nn.Linear(2, 2))


def test_v_schedules_place_two_stages_per_rank_in_a_v_and_loops_interleave():
    assert [stage_ids_of_rank(r, 4, 2, v_shape=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids_of_rank(r, 2, 2, v_shape=False) for r in range(2)] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("options", "per_rank"),
    [
        (PipelineOptions(schedule="1F1B"), 1),
        (PipelineOptions(schedule="Interleaved1F1B"), 2),
        (PipelineOptions(schedule="LoopedBFS", layers_per_stage=1), 5),  # (8 + 2) / 1 / pp
        (PipelineOptions(schedule="1F1B", layers_per_stage=5), 1),  # 1F1B runs one: (8 + 2) / 5 / pp
        (
            PipelineOptions(
                schedule="InterleavedZeroBubble", split_points=("layers.2", "layers.4", "layers.6")
            ),
            2,
        ),
    ],
)
def test_stages_per_rank_follow_the_schedule_and_split(options, per_rank):
    assert stages_per_rank(options, pp=2, n_layers=8) == per_rank


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            PipelineOptions(schedule="GPipe", layers_per_stage=1),
            "GPipe runs one stage per rank, but the split gives 5",
        ),
        (PipelineOptions(schedule="ZBVZeroBubble", layers_per_stage=1), "exactly 2 stages per rank"),
        (
            PipelineOptions(schedule="Interleaved1F1B", layers_per_stage=5),
            "runs several stages per rank, but the split gives 1",
        ),
        (
            PipelineOptions(schedule="1F1B", layers_per_stage=4),
            r"3 pipeline stages \(ceil\(\(8 layers \+ embedding \+ output = 10\) / pipeline\.layers_per_stage\)\) cannot",
        ),
        (
            PipelineOptions(schedule="1F1B", split_points=("layers.3", "layers.5")),
            "3 pipeline stages",
        ),
    ],
)
def test_splits_a_schedule_cannot_run_are_refused(options, message):
    with pytest.raises(ParallelConfigError, match=message):
        stages_per_rank(options, pp=2, n_layers=8)

"""Each settings group refuses values that cannot work, naming the field, the value and the choices;
ParallelOptions refuses a group of the wrong type. (float8 and mx: test_float8.py, test_mx.py.)"""

import pytest
import torch

from titan_parallel import (
    ActivationCheckpointing,
    Compile,
    ContextParallelOptions,
    DataParallelOptions,
    Float8Training,
    ParallelConfigError,
    ParallelDims,
    ParallelOptions,
    PipelineOptions,
    TensorParallelOptions,
)
from titan_parallel.parallelize import describe_layout


@pytest.mark.parametrize(
    ("group", "kwargs", "message"),
    [
        (
            DataParallelOptions,
            {"reshard_after_forward": "sometimes"},
            r"data_parallel\.reshard_after_forward='sometimes' is unknown; choose one of \['default'",
        ),
        (ActivationCheckpointing, {"mode": "partial"}, r"activation_checkpoint\.mode='partial' is unknown"),
        (
            ActivationCheckpointing,
            {"mode": "selective", "selective": "matmul"},
            r"activation_checkpoint\.selective must be 'op' or a positive integer, got 'matmul'",
        ),
        (
            ActivationCheckpointing,
            {"mode": "selective", "selective": 0},
            r"activation_checkpoint\.selective must be >= 1, got 0",
        ),
        (Compile, {"enabled": True, "backend": ""}, r"compile\.backend is empty"),
        (
            PipelineOptions,
            {"schedule": "DualPipe"},
            r"pipeline\.schedule='DualPipe' is unknown; choose one of \['1F1B', 'GPipe'",
        ),
        (PipelineOptions, {"microbatch_size": 0}, r"pipeline\.microbatch_size must be >= 1, got 0"),
        (PipelineOptions, {"layers_per_stage": 2, "split_points": ("layers.2",)}, "not both"),
        (PipelineOptions, {"schedule": "PipelineScheduleMulti"}, r"give pipeline\.schedule_csv"),
        (
            PipelineOptions,
            {"first_stage_less_layers": -1},
            r"pipeline\.first_stage_less_layers and pipeline\.last_stage_less_layers must be >= 0",
        ),
        (
            ContextParallelOptions,
            {"rotate_method": "ring"},
            r"context_parallel\.rotate_method='ring' is unknown",
        ),
        (
            Float8Training,
            {"recipe": "mxfp8"},
            r"float8\.recipe='mxfp8' is unknown; choose one of \['tensorwise', 'rowwise'\]",
        ),
    ],
)
def test_each_group_refuses_a_bad_value_naming_its_field(group, kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        group(**kwargs)


def test_a_group_of_the_wrong_type_is_refused_naming_the_group():
    with pytest.raises(ParallelConfigError, match=r"ParallelOptions\.float8 takes a Float8Training or None"):
        ParallelOptions(float8="tensorwise")
    with pytest.raises(ParallelConfigError, match=r"ParallelOptions\.pipeline takes a PipelineOptions, got"):
        ParallelOptions(pipeline=None)


def test_selective_every_n_blocks_accepts_torchtitans_string_form():
    assert ActivationCheckpointing(mode="selective", selective="2").selective_every == 2
    assert ActivationCheckpointing(mode="selective").selective_every is None


def test_groups_apply_themselves_only_when_on():
    """Compile and activation checkpointing switched off leave the blocks as they are; on, they wrap them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    blocks = {"0": model[0]}
    forward = model[0].forward
    Compile(enabled=False).apply(model, blocks)
    ActivationCheckpointing(mode="none").apply(model, blocks)
    assert model[0].forward == forward and model[0]._compiled_call_impl is None
    Compile(enabled=True, backend="eager").apply(model, blocks)  # compiles lazily, at the first call
    ActivationCheckpointing(mode="full").apply(model, blocks)
    assert model[0].forward != forward and model[0]._compiled_call_impl is not None


def test_the_parallelize_log_line_names_the_degrees_and_what_is_on_not_every_default():
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    options = ParallelOptions(
        activation_checkpoint=ActivationCheckpointing(mode="full"),
        compile=Compile(enabled=True),
        float8=Float8Training(emulate=True),
        tensor_parallel=TensorParallelOptions(sequence_parallel=True, loss_parallel=False),
    )
    assert describe_layout(dims, options) == (
        "dp_shard 2, tp 2; params float32, reduce float32, sequence parallel, activation checkpointing full, "
        "compile (inductor), float8 tensorwise emulated"
    )
    assert describe_layout(ParallelDims(world_size=1), ParallelOptions()) == (
        "one rank; params float32, reduce float32"
    )

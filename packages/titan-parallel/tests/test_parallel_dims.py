import pytest

from titan_parallel import ParallelConfigError, ParallelDims


def test_dp_shard_minus_one_takes_the_rest_of_the_world():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, world_size=8)
    assert dims.dp_shard == 2
    assert dims.dp_degree == 4


def test_degrees_that_do_not_multiply_to_world_size_are_refused_with_the_numbers():
    with pytest.raises(ParallelConfigError, match=r"dp_shard\(2\) .* tp\(2\) .* = 4, but WORLD_SIZE is 2"):
        ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=2)


def test_inferred_dp_shard_needs_a_divisor_of_world_size():
    with pytest.raises(ParallelConfigError, match="does not divide WORLD_SIZE 6"):
        ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=4, pp=1, world_size=6)


@pytest.mark.parametrize("name", ["dp_replicate", "cp", "tp", "pp"])
def test_degrees_below_one_are_refused(name):
    degrees = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=1)
    degrees[name] = 0
    with pytest.raises(ParallelConfigError, match=f"{name} must be >= 1"):
        ParallelDims(**degrees)


def _dims(**degrees):
    return ParallelDims(**{"dp_shard": -1, **degrees, "world_size": 8})


def test_tp_must_divide_the_number_of_heads():
    with pytest.raises(ParallelConfigError, match=r"tp\(4\) does not divide the model's n_heads \(6\)"):
        _dims(tp=4).check_model(n_heads=6)
    with pytest.raises(ParallelConfigError, match=r"tp\(4\) does not divide the model's n_kv_heads \(2\)"):
        _dims(tp=4).check_model(n_heads=8, n_kv_heads=2)
    _dims(tp=4).check_model(n_heads=8, n_kv_heads=4)


def test_tp_must_divide_the_vocabulary():
    with pytest.raises(ParallelConfigError, match=r"tp\(2\) does not divide vocab_size \(2049\)"):
        _dims(tp=2).check_model(vocab_size=2049)


@pytest.mark.parametrize(
    ("degrees", "seq_len", "needed"),
    [
        ({"cp": 2}, 6, r"2\*cp\(2\) = 4"),
        ({"tp": 4}, 6, r"tp\(4\) = 4"),
        ({"cp": 2, "tp": 2}, 12, r"2\*cp\(2\) \* tp\(2\) = 8"),
    ],
)
def test_seq_len_must_divide_into_what_cp_and_tp_cut_it_into(degrees, seq_len, needed):
    with pytest.raises(ParallelConfigError, match=rf"seq_len \({seq_len}\) is not divisible by {needed}"):
        _dims(**degrees).check_model(seq_len=seq_len)


def test_seq_len_needs_no_tp_divisor_without_sequence_parallel():
    _dims(tp=4).check_model(seq_len=6, sequence_parallel=False)
    _dims(cp=2, tp=2).check_model(seq_len=16)


def test_pp_larger_than_the_number_of_layers_is_refused():
    with pytest.raises(
        ParallelConfigError,
        match=r"pp\(4\) \* stages per rank\(2\) = 8 pipeline stages, but the model has only 6",
    ):
        _dims(pp=4).check_model(n_layers=6, stages_per_rank=2)
    _dims(pp=4).check_model(n_layers=6)


def test_a_mesh_must_be_built_before_its_views_are_used():
    with pytest.raises(RuntimeError, match=r"build_mesh\(\) must be called"):
        _dims(tp=2).submesh("tp")
    with pytest.raises(ParallelConfigError, match="unknown mesh name 'data'"):
        _dims(tp=2).submesh("data")


def test_cp_alone_shards_parameters_and_dp_replicate_alone_replicates_them():
    cp_only = ParallelDims(dp_shard=1, cp=2, world_size=2)
    assert cp_only.fsdp_enabled and not cp_only.ddp_enabled and cp_only.dp_degree == 1
    ddp = ParallelDims(dp_replicate=2, dp_shard=1, world_size=2)
    assert ddp.ddp_enabled and not ddp.fsdp_enabled and ddp.dp_degree == 2

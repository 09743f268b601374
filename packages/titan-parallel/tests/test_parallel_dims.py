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

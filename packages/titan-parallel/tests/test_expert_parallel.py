import pytest
import torch

from titan_parallel import ParallelConfigError, ParallelDims
from titan_parallel.expert_parallel import expert_major_order


def test_ep_borrows_data_and_context_ranks_and_efsdp_takes_the_rest():
    dims = ParallelDims(dp_shard=-1, cp=2, tp=2, ep=2, etp=2, world_size=16)
    assert (dims.dp_shard, dims.efsdp, dims.expert_gradient_divide_factor) == (4, 4, 8)
    borrowing_tp = ParallelDims(dp_shard=2, tp=2, ep=4, world_size=4)
    assert borrowing_tp.efsdp == 1


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (
            {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 3},
            r"expert_tensor_parallel_degree\(3\) must be 1 or tp\(2\)",
        ),
        (
            {"dp_shard": 2, "tp": 2, "ep": 4, "etp": 2},
            r"expert_parallel_degree\(4\) does not divide dp_shard\(2\)",
        ),
        (
            {"dp_shard": 4, "ep": 3},
            r"expert_parallel_degree\(3\) does not divide dp_shard\(4\) \* cp\(1\) = 4",
        ),
        ({"dp_shard": 4, "ep": 0}, r"expert_parallel_degree must be >= 1"),
        ({"dp_shard": 2, "dp_replicate": 2, "ep": 4}, r"expert_parallel_degree\(4\) does not divide"),
    ],
)
def test_expert_layouts_that_cannot_work_are_refused_with_the_fields(degrees, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelDims(**degrees, world_size=4)


def test_the_model_must_split_into_whole_experts_and_hidden_slices():
    with pytest.raises(
        ParallelConfigError,
        match=r"expert_parallel_degree\(4\) does not divide the model's num_experts \(6\)",
    ):
        ParallelDims(dp_shard=4, ep=4, world_size=4).check_model(num_experts=6)
    with pytest.raises(
        ParallelConfigError, match=r"hidden dim \(31\) is not divisible by the expert_tensor_parallel"
    ):
        ParallelDims(dp_shard=2, tp=2, ep=2, etp=2, world_size=4).check_model(expert_hidden_dim=31)


def test_received_rows_are_regrouped_by_local_expert():
    # 2 source ranks x 2 local experts: rank 0 sent 1 row for e0 and 2 for e1; rank 1 sent 2 and 0.
    received = torch.tensor([1, 2, 2, 0])
    rows = torch.tensor([0, 1, 2, 3, 4])  # s0e0, s0e1, s0e1, s1e0, s1e0
    order, local_counts = expert_major_order(received, ep=2)
    assert rows[order].tolist() == [0, 3, 4, 1, 2]
    assert local_counts.tolist() == [3, 2]

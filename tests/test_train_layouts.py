"""Every parallelism wired into titan-train computes the same run as one process, through the CLI."""

import pytest

SHAPE = ("--training.steps", "3", "--training.seq_len", "64", "--training.local_batch_size", "4",
         "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
         "--training.dataloader.num_streams", "1")  # fmt: skip

LAYOUTS = {
    "tp2_sp_loss_parallel": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2_1f1b": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"),
    "cp2_allgather": ("--parallelism.context_parallel_degree", "2"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train):
    return train(tmp_path_factory.mktemp("one_process"), *SHAPE)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_on_two_ranks_matches_one_process(layout, reference, tmp_path, train):
    losses = train(tmp_path, *SHAPE, *LAYOUTS[layout], nproc=2)
    assert sorted(losses) == [1, 2, 3]
    for step in (1, 2, 3):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4)

"""Several nodes: two torchrun "nodes" of 2 ranks each on localhost train as one 4-rank job."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import environment, free_port, logged_losses, run, torchrun_command  # noqa: E402

STEPS = 3
# The global batch is fixed: 4 ranks x 2 sequences, always dealt from 4 document streams.
JOB = ("--training.steps", str(STEPS), "--training.dataloader.num_streams", "4")


@pytest.mark.slow
def test_two_torchrun_nodes_of_two_ranks_train_together_like_one_four_rank_node(tmp_path):
    single = tmp_path / "single"
    result = run(torchrun_command(single, *JOB, nproc=4, port=free_port()))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    nodes = tmp_path / "nodes"
    port = free_port()  # the c10d rendezvous both nodes meet at
    launches = [
        subprocess.Popen(
            torchrun_command(nodes, *JOB, nproc=2, nnodes=2, node_rank=node, port=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment(),
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [launch.communicate(timeout=400)[0] for launch in launches]
    for launch, output in zip(launches, outputs, strict=True):
        assert launch.returncode == 0, output[-4000:]
    assert any("world size 4" in output for output in outputs)

    expected = logged_losses(single)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert logged_losses(nodes) == expected

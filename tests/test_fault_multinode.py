"""Several nodes: two torchrun "nodes" of 2 ranks each on localhost train as one 4-rank job, and recover
together when one of their ranks is killed."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import (  # noqa: E402
    cli_args,
    environment,
    free_port,
    logged_losses,
    run_forked_ranks,
    torchrun_command,
)

STEPS = 4
# The global batch is fixed: 4 ranks x 2 sequences, always dealt from 4 document streams.
JOB = (
    "--training.steps",
    str(STEPS),
    "--training.dataloader.num_streams",
    "4",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
)
KILL_RANK_3_AFTER_STEP_3 = ("--health.drill", "kill", "--health.drill_rank", "3", "--health.drill_step", "3")


@pytest.mark.slow
def test_two_torchrun_nodes_train_as_one_four_rank_node_and_restart_together_after_a_sigkill(tmp_path):
    single = tmp_path / "single"  # four ranks on one node (forked from one import, env:// rendezvous)
    statuses, outputs = run_forked_ranks(cli_args(single, *JOB), 4, single)
    assert statuses == [0, 0, 0, 0], outputs[0][-4000:]
    expected = logged_losses(single)
    assert sorted(expected) == list(range(1, STEPS + 1))

    # Two nodes meeting at one c10d rendezvous; rank 3 (on the second node) dies after step 3 and every
    # rank of both nodes restarts (--max-restarts 1) from the step-2 checkpoint.
    nodes = tmp_path / "nodes"
    port = free_port()
    launches = [
        subprocess.Popen(
            torchrun_command(
                nodes,
                *JOB,
                *KILL_RANK_3_AFTER_STEP_3,
                nproc=2,
                nnodes=2,
                node_rank=node,
                port=port,
                max_restarts=1,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment(),
        )
        for node in (0, 1)
    ]
    outputs = [launch.communicate(timeout=500)[0] for launch in launches]
    for launch, output in zip(launches, outputs, strict=True):
        assert launch.returncode == 0, output[-4000:]
    both = "\n".join(outputs)
    assert "world size 4" in both
    assert "fault drill: SIGKILL after step 3" in both and "exitcode: -9" in both
    assert "resuming from step-2" in both
    assert logged_losses(nodes) == expected

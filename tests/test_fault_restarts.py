"""Preemption on a 2-rank torchrun job: every rank saves and stops, and the rerun ends with the losses of an
uninterrupted run. (A SIGKILLed rank: see test_fault_multinode.py; the SLURM script under a real SLURM
cluster: tests/slurm/test_slurm_jobs.py.)"""

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import (  # noqa: E402
    cli_args,
    free_port,
    logged_losses,
    rank_lines,
    run,
    run_forked_ranks,
    send_signal_to_rank,
    start,
    torchrun_command,
    wait_for_step,
)

STEPS = 6
# Every run: 2 ranks, checkpoints every 2 steps (all kept), the same data dealing.
JOB = (
    "--training.steps",
    str(STEPS),
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--training.dataloader.num_streams",
    "2",
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("uninterrupted")  # two ranks forked from one import, env:// rendezvous
    statuses, outputs = run_forked_ranks(cli_args(dump, *JOB), 2, dump)
    assert statuses == [0, 0], outputs[0][-4000:]
    losses = logged_losses(dump)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_after_one_step_with_a_checkpoint_and_a_rerun_matches(
    tmp_path, uninterrupted
):
    command = torchrun_command(tmp_path, *JOB, nproc=2, port=free_port())
    job = start(command)
    wait_for_step(tmp_path, 1, job)
    send_signal_to_rank(job, 1, signal.SIGTERM)  # as a scheduler would, to one process only
    output, _ = job.communicate(timeout=300)

    lines = {rank: [line for line in rank_lines(output, rank) if "preempted:" in line] for rank in (0, 1)}
    assert len(lines[0]) == 1 and len(lines[1]) == 1, output[-4000:]
    stopped_at = int(lines[0][0].split("finished step ")[1].split()[0])
    assert 1 < stopped_at < STEPS
    for rank in (0, 1):
        assert f"SIGTERM received; finished step {stopped_at} and saved" in lines[rank][0]
        assert "run the same command again to resume" in lines[rank][0]
    assert "exitcode  : 3" in output  # torchrun's report: both ranks left with the preemption status
    assert (tmp_path / "checkpoint" / f"step-{stopped_at}").is_dir()
    assert max(logged_losses(tmp_path)) == stopped_at

    resumed = run(command)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"resuming from step-{stopped_at}" in resumed.stdout
    losses = logged_losses(tmp_path)
    assert [losses[s] for s in range(1, STEPS + 1)] == [uninterrupted[s] for s in range(1, STEPS + 1)]

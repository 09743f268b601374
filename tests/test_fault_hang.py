"""Hangs: a rank that stops responding, and a process group that never forms, are reported, not waited out."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import cli_args, environment, free_port, rank_lines, run, torchrun_command  # noqa: E402


@pytest.mark.slow
def test_rank_that_stops_responding_is_named_with_the_collective_the_others_wait_in(tmp_path):
    hang = ("--health.drill", "hang", "--health.drill_rank", "1", "--health.drill_step", "2")
    result = run(
        torchrun_command(tmp_path, "--training.steps", "3", *hang, "--comm.train_timeout_seconds", "10",
                         nproc=2, port=free_port()),
        timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    lines = {rank: [line for line in rank_lines(result.stdout, rank) if " ERROR " in line] for rank in (0, 1)}
    assert len(lines[0]) == len(lines[1]) == 1, result.stdout[-5000:]
    assert lines[0][0].split(" ERROR ")[1] == lines[1][0].split(" ERROR ")[1]  # the same line on every rank
    report = lines[0][0]
    assert "hang: rank 0 timed out in gloo:" in report and "at step 2 (forward/backward)" in report
    assert (
        "rank 1 never reached it: at step 2 (forward/backward), is at titan_train/fault_drills.py" in report
    )
    assert "in before_step" in report
    assert f"flight-recorder dumps in {tmp_path / 'comm_traces'}" in report
    assert sorted(p.name for p in (tmp_path / "comm_traces").glob("rank_*.json")) == [
        "rank_0.json",
        "rank_1.json",
    ]
    assert "exitcode  : 5" in result.stdout + result.stderr
    assert "Traceback" not in "\n".join(rank_lines(result.stdout, 0) + rank_lines(result.stdout, 1))


def test_process_group_that_never_forms_stops_after_the_init_timeout_with_one_line(tmp_path):
    env = {**environment(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    command = [
        sys.executable,
        "-m",
        "titan_train.cli",
        *cli_args(tmp_path, "--comm.init_timeout_seconds", "3"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 5, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert "init: rank 0 could not form the 2-rank process group at 127.0.0.1:" in errors[0]
    assert "within comm.init_timeout_seconds = 3 s" in errors[0] and "Fix: start every rank" in errors[0]
    assert "Traceback" not in result.stdout + result.stderr

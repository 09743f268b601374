"""Hangs: a rank that stops responding, and a process group that never forms, are reported, not waited out.

The ranks are forked titan-train processes forming a gloo group (see fault_runs.run_forked_ranks).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import cli_args, free_port, run_forked_ranks, start_forked  # noqa: E402


@pytest.mark.slow
def test_rank_that_stops_responding_is_named_with_the_collective_the_others_wait_in(tmp_path):
    hang = ("--health.drill", "hang", "--health.drill_rank", "1", "--health.drill_step", "2")
    argv = cli_args(tmp_path, "--training.steps", "3", *hang, "--comm.train_timeout_seconds", "10")
    statuses, outputs = run_forked_ranks(argv, 2, tmp_path)
    assert statuses == [5, 5], outputs
    lines = []
    for output in outputs:
        errors = [line for line in output.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
        lines.append(errors[0].split(" ERROR ")[1])
    assert lines[0] == lines[1]  # the same line on every rank
    report = lines[0]
    assert "hang: rank 0 timed out in gloo:" in report and "at step 2 (forward/backward)" in report
    assert (
        "rank 1 never reached it: at step 2 (forward/backward), is at titan_train/faults/drills.py" in report
    ), report
    assert "in before_step" in report
    assert f"flight-recorder dumps in {tmp_path / 'comm_traces'}" in report
    assert sorted(p.name for p in (tmp_path / "comm_traces").glob("rank_*.json")) == [
        "rank_0.json",
        "rank_1.json",
    ]


def test_process_group_that_never_forms_stops_after_the_init_timeout_with_one_line(tmp_path):
    # Rank 0 of a 2-rank job whose rank 1 never starts.
    port = str(free_port())
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    process = start_forked(
        cli_args(tmp_path, "--comm.init_timeout_seconds", "3"), env, tmp_path / "rank0.log"
    )
    process.join(timeout=120)
    output = (tmp_path / "rank0.log").read_text()
    assert process.exitcode == 5, output[-3000:]
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1
    assert f"init: rank 0 could not form the 2-rank process group at 127.0.0.1:{port}" in errors[0]
    assert "within comm.init_timeout_seconds = 3 s" in errors[0] and "Fix: start every rank" in errors[0]
    assert "Traceback" not in output

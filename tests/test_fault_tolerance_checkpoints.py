"""torchtitan 0.2.2's own torchft integration case through apps/run_train.sh on this CPU at 2 replica groups,
the checkpoints it leaves in torchtitan's layout, and a whole-job resume from them.

torchtitan's runner (`tests/integration_tests/ft.py`, case `default_torchft`) calls its run_train.sh once per
replica group, every group with the same `--job.dump_folder`, `--fault_tolerance.enable
--fault_tolerance.replica_id=I --fault_tolerance.group_size=G`, and the case's flags (`--training.steps 10
--checkpoint.enable_checkpoint`), the lighthouse named by TORCHFT_LIGHTHOUSE. Here: its integration base
config cut for CPU (tests/torchtitan_features/cases.py), one rank per group.

The resume: a 12-step run of 2 groups that need each other for every step (`min_replica_size 2`, so the
trajectory does not depend on which group starts first) through Titan's own launch (`FT_REPLICA_GROUPS=2`),
saving at steps 5 and 10; its checkpoint folder cut back to step 10 is resumed by both groups to step 12, and
each group's steps 11 and 12 (loss and grad_norm) must equal the uninterrupted run's. Planted once
(2026-12-02): the groups' own data positions not loaded (each group's data from the start of its share)
made group 0's step-11 loss 6.687 where the uninterrupted run had 7.948 (the test fails).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_features.cases import BASE_CONFIG, CUT, REPO  # noqa: E402

from titan_train.fault_tolerance import LIGHTHOUSE_ENV, start_lighthouse  # noqa: E402

GROUPS = 2
DEFAULT_TORCHFT = ["--training.steps", "10", "--checkpoint.enable_checkpoint"]  # the case's flags


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "CONFIG_FILE": str(BASE_CONFIG), "NGPU": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _cut() -> list[str]:
    return shlex.split(" ".join(CUT))


def _records(dump: Path, group: int) -> dict[int, dict]:
    lines = (dump / f"replica_group_{group}" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


def _torchtitan_launch(dump: Path, flags: list[str], lighthouse: str) -> list[subprocess.CompletedProcess]:
    """One run_train.sh per group, started together, as torchtitan's runner does."""
    jobs = []
    for group in range(GROUPS):
        ft = [
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={group}",
            f"--fault_tolerance.group_size={GROUPS}",
        ]
        argv = [str(REPO / "apps" / "run_train.sh"), *ft, "--job.dump_folder", str(dump), *_cut(), *flags]
        jobs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=_env(**{LIGHTHOUSE_ENV: lighthouse}),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return [subprocess.CompletedProcess(job.args, job.wait(timeout=900), job.stdout.read()) for job in jobs]


def _titan_launch(dump: Path, flags: list[str]) -> subprocess.CompletedProcess:
    """Titan's launch of every group and the lighthouse: FT_REPLICA_GROUPS=2 apps/run_train.sh."""
    port = str(_free_port())
    argv = [str(REPO / "apps" / "run_train.sh"), "--job.dump_folder", str(dump), *_cut(), *flags]
    # The lighthouse forms no quorum without both groups: a group that started first would otherwise train
    # uncommitted steps alone (their batches lost, as torchft does), as many as the other's start took.
    env = _env(
        FT_REPLICA_GROUPS=str(GROUPS), FT_LIGHTHOUSE_PORT=port, FT_LIGHTHOUSE_MIN_REPLICAS="2", LOG_RANK="0"
    )
    env.pop(LIGHTHOUSE_ENV, None)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchtitans_default_torchft_case_trains_at_two_groups_and_saves_in_its_layout(tmp_path):
    lighthouse = start_lighthouse(1, join_timeout_ms=10000)
    try:
        runs = _torchtitan_launch(tmp_path / "default_torchft", DEFAULT_TORCHFT, lighthouse.address())
    finally:
        lighthouse.shutdown()
    assert [r.returncode for r in runs] == [0, 0], "\n\n".join(r.stdout[-3000:] for r in runs)
    dump = tmp_path / "default_torchft"
    for group in range(GROUPS):
        assert max(_records(dump, group)) == 10
        assert (dump / "checkpoint" / f"ft-replicat-{group}" / "step-10" / ".metadata").is_file()
    assert (dump / "checkpoint" / "step-10" / ".metadata").is_file()  # one full checkpoint, from one group
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [
        "ft-replicat-0",
        "ft-replicat-1",
        "step-10",
    ]


@pytest.mark.slow
def test_a_whole_job_resume_gives_each_group_its_own_data_and_the_uninterrupted_steps(tmp_path):
    flags = ["--checkpoint.enable", "--checkpoint.interval", "5", "--fault_tolerance.min_replica_size", "2"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run = _titan_launch(whole, [*flags, "--training.steps", "12"])
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    # The job stopped after step 10: the checkpoints of steps 5 and 10, no later one.
    shutil.copytree(whole / "checkpoint", resumed / "checkpoint")
    for folder in [resumed / "checkpoint", *(resumed / "checkpoint").glob("ft-replicat-*")]:
        shutil.rmtree(folder / "step-12")
    run = _titan_launch(resumed, [*flags, "--training.steps", "12"])
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert run.stdout.count("resuming from step-10") + run.stderr.count("resuming from step-10") >= 1
    for group in range(GROUPS):
        before, after = _records(whole, group), _records(resumed, group)
        assert sorted(after) == [11, 12]
        assert before[12]["ft_uncommitted_steps"] == after[12]["ft_uncommitted_steps"] == 0, (before, after)
        for step in (11, 12):
            got = (after[step]["loss"], after[step]["grad_norm"])
            want = (before[step]["loss"], before[step]["grad_norm"])
            assert got == pytest.approx(want, rel=1e-6), (group, step, got, want)
    # The groups read different data: their losses differ at every step.
    assert _records(whole, 0)[11]["loss"] != _records(whole, 1)[11]["loss"]

"""The torchft drill: a lighthouse and 2 replica groups of 2 ranks (gloo), one group's rank SIGKILLed.

Group 1 runs under torchrun with one restart allowed and `[health] drill = kill` on its rank 1 at
`kill_step` (SIGKILL after that step, first attempt only), so torchrun restarts the group, which heals from
group 0 while group 0 trains on without a restart. Imported by tests/test_fault_tolerance.py and
bench/ft_drill.py.

On a shared 2-core machine a start or restart costs tens of seconds of imports, in which the tiny model
trains hundreds of steps; rather than train that long, the drill pauses group 0 (SIGSTOP to its ranks, as a
slow node would be) while group 1 starts, and resumes it (SIGCONT) once group 1 has asked the lighthouse
for a quorum. The lighthouse counts a paused group as alive for `heartbeat_timeout_ms` (60 s) and waits
`join_timeout_ms` (10 s) for it, so the groups meet in the next quorum. Group 0 is paused after its first
step (group 1 then joins behind it and heals, as a late group does) and again after `ALONE` steps with a
quorum of 1 following the kill; it is never restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import environment, free_port, torchrun_command, worker_pid  # noqa: E402

from titan_train.fault_tolerance import LIGHTHOUSE_ENV, start_lighthouse  # noqa: E402
from titan_train.fault_tolerance.group_folders import group_output_folder  # noqa: E402

ALONE = 1  # steps group 0 commits with a quorum of 1 after the kill before it is paused
WORKERS = Path(__file__).parent / "workers"
# The tiny llama (tests/workers/tiny_llama_flavor.py) on 2 ranks per group; a failed peer is given up on
# after 5 s (process_group_timeout_ms).
GROUP = (
    "--experimental.custom_import",
    "tiny_llama_flavor",
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--fault_tolerance.enable",
    "--fault_tolerance.group_size",
    "2",
    "--fault_tolerance.process_group_timeout_ms",
    "5000",
)


@dataclass
class GroupRun:
    status: int
    log: str
    records: dict[int, dict]  # metrics.jsonl by step (the last life of the group)
    digests: dict[int, tuple[int, str]]  # rank: (step, digest of its weights and optimizer state)


@dataclass
class DrillResult:
    kill_step: int
    seconds: float
    groups: list[GroupRun]

    @property
    def identical(self) -> bool:
        """Both groups' ranks end at the same step with the same weights and optimizer state."""
        a, b = (g.digests for g in self.groups)
        return len(a) == 2 and a == b

    def heal_line(self) -> str:
        """Group 1's last heal, as it logged it."""
        return next(
            (line for line in reversed(self.groups[1].log.splitlines()) if "healed from a live" in line), ""
        )


def _records(dump: Path) -> dict[int, dict]:
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


def _group_run(dump: Path, status: int, log: Path) -> GroupRun:
    records = _records(dump)
    digests = {}
    for path in sorted((dump / "fault_tolerance").glob("digest_rank*.json")):
        d = json.loads(path.read_text())
        digests[d["rank"]] = (d["step"], d["digest"])
    return GroupRun(status, log.read_text(), records, digests)


def run_drill(folder: Path, kill_step: int, steps: int, timeout: float = 500, *extra: str) -> DrillResult:
    """Run the drill in `folder` (a dump folder and log per group); `extra` flags go to both groups."""
    lighthouse = start_lighthouse(1, join_timeout_ms=10000, heartbeat_timeout_ms=60000)
    env = {**environment(), LIGHTHOUSE_ENV: lighthouse.address(), "PYTHONPATH": str(WORKERS)}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    drill = ("--health.drill", "kill", "--health.drill_step", str(kill_step), "--health.drill_rank", "1")
    started = time.perf_counter()
    jobs = []
    try:
        for replica in (0, 1):
            dump = folder / f"group{replica}"
            command = torchrun_command(
                dump,
                *GROUP,
                "--training.steps",
                str(steps),
                "--fault_tolerance.replica_id",
                str(replica),
                *(drill if replica == 1 else ()),
                *extra,
                nproc=2,
                port=free_port(),
                max_restarts=replica,  # group 1: torchrun restarts it once after the kill
            )
            log = folder / f"group{replica}.log"
            job = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
            outputs = group_output_folder(dump, replica)  # metrics.jsonl and digests (not the checkpoints)
            jobs.append((outputs, log, job))
            if replica == 0:
                _wait(lambda d=outputs: 1 in _records(d), [job], started + timeout)
                _signal_group(job, signal.SIGSTOP)
        (dump0, _, group0), (_, log1, group1) = jobs
        deadline = started + timeout
        _wait(lambda: log1.read_text().count(_ASKS) >= 2, [group1], deadline)  # both ranks, first life
        _signal_group(group0, signal.SIGCONT)

        def alone() -> bool:
            after = [r for s, r in _records(dump0).items() if s > kill_step and r["ft_quorum_size"] == 1]
            return len(after) >= ALONE

        if _wait(alone, [group0, group1], deadline):
            _signal_group(group0, signal.SIGSTOP)
            _wait(lambda: log1.read_text().count(_ASKS) >= 4, [group1], deadline)  # the restarted life
            _signal_group(group0, signal.SIGCONT)
        statuses = []
        for _, _, job in jobs:
            try:
                statuses.append(job.wait(timeout=max(1.0, deadline - time.perf_counter())))
            except subprocess.TimeoutExpired:
                job.kill()
                statuses.append(job.wait())
    finally:
        for _, _, job in jobs:
            if job.poll() is None:
                _signal_group(job, signal.SIGCONT)
                job.kill()
        lighthouse.shutdown()
    seconds = time.perf_counter() - started
    return DrillResult(
        kill_step, seconds, [_group_run(d, s, log) for (d, log, _), s in zip(jobs, statuses, strict=True)]
    )


_ASKS = "asks the lighthouse for its first quorum"


def _wait(condition, jobs: list[subprocess.Popen], deadline: float) -> bool:
    """Poll `condition` until it holds (True), a job ends or the deadline passes (False)."""
    while time.perf_counter() < deadline and all(job.poll() is None for job in jobs):
        if condition():
            return True
        time.sleep(0.2)
    return False


def _signal_group(job: subprocess.Popen, sig: signal.Signals) -> None:
    for rank in (0, 1):
        try:
            os.kill(worker_pid(job.pid, rank), sig)
        except AssertionError:  # the rank has exited
            pass

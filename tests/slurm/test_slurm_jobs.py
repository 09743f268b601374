"""apps/multinode_trainer.slurm under a real two-node SLURM cluster (tests/slurm/cluster.py), through sbatch.

One job of 2 nodes x 2 ranks lives through what clusters do to it, and still logs, step by step, the
losses and gradient norms of one uninterrupted 4-rank run on one node:

1. its time limit arrives mid-run: SLURM's early signal (`--signal=B:USR1@100`) reaches the script, every
   rank saves and stops, and the script requeues the job;
2. it is preempted (`scancel --signal=TERM`): every rank saves, the job exits with status 3, and
   `scontrol requeue` resumes it;
3. node n2 dies (every process in its namespace killed, the namespace removed): the ranks on n1 stop with
   one line naming ranks 2 and 3, SLURM finds the node down and requeues the job, which resumes from the
   newest complete checkpoint once the node is back.

SLURM counts time limits in minutes and checks them every 30 s, so the job starts with a long limit and
the test cuts it once training runs to what leaves 40 to 100 s (the signal then comes within 30 s, however
long start-up took); the `stall` drill holds the run before step 3 until that signal comes instead of
spending steps. The check may come before the stall too, so the run stops after step 1, 2 or 3: whichever
step it saved is the one the requeued job must resume from.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from cluster import Cluster, install, unavailable_reason  # noqa: E402
from fault_runs import DEBUG_CONFIG, REPO, TINY, run_forked_ranks  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 14
STALL_STEP = 3
# The global batch is fixed (4 ranks x 2 sequences from 4 document streams); every step's checkpoint kept.
JOB = (
    *TINY,
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
STALL = ("--health.drill", "stall", "--health.drill_rank", "3", "--health.drill_step", str(STALL_STEP))
WAIT = 400  # seconds any one phase may take on a busy machine
SIGNAL_LEAD = 100  # --signal=B:USR1@100: the script's warning, 100 s before the time limit


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        install()
    except RuntimeError as err:  # no package mirror, say
        pytest.skip(str(err))
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _records(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _by_step(dump: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad_norm); a resumed run appends, later lines win."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(dump)}


def _complete_checkpoints(dump: Path) -> list[int]:
    """Steps of the published checkpoints (a save in progress is `step-N.partial`)."""
    folder = dump / "checkpoint"
    names = [p.name for p in folder.glob("step-*")] if folder.exists() else []
    return sorted(int(name[5:]) for name in names if name[5:].isdigit())


def _wait(condition, what: str, timeout: float = WAIT, every: float = 0.1) -> None:
    """Poll `condition` every `every` seconds: files often (a node is killed between two saves), SLURM's
    state once a second (each look is an `scontrol` process and a controller request, minutes of polls)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def _limit_due_now(run_time: str) -> int:
    """Minutes of time limit that leave the job 40 to 100 s: SIGNAL_LEAD is then due at the next check (every
    30 s), and the limit itself comes at least one check later, after the ranks have saved."""
    parts = [int(x) for x in run_time.replace("-", ":").split(":")]
    elapsed = sum(value * unit for value, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False))
    return (elapsed + SIGNAL_LEAD) // 60


def _veth_bytes(node: str) -> int:
    stats = Path(f"/sys/class/net/tslurm-{node}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


@pytest.mark.timeout(1200)  # four phases, each waited on with its own limit (WAIT)
def test_two_node_job_survives_time_limit_preemption_and_a_lost_node_with_the_losses_of_one_node(
    cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest
):
    dump, logs, output = tmp_path / "dump", tmp_path / "logs", tmp_path / "job.out"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
        "CONFIG_FILE": str(DEBUG_CONFIG),
        "DUMP_FOLDER": str(dump),
        "LOG_DIR": str(logs),
        "LOG_RANK": "0,1",
        "SOCKET_IFNAME": "titan0",
        "SKIP_CHECK": "1",  # the check has its own test below; here it would cost an import per submission
    }
    job = cluster.sbatch(
        "--nodes=2",
        "--gpus-per-node=2",
        "--time=10",
        f"--signal=B:USR1@{SIGNAL_LEAD}",
        f"--output={output}",
        str(REPO / "apps" / "multinode_trainer.slurm"),
        *JOB,
        *STALL,
        env=env,
        cwd=tmp_path,
    )
    request.addfinalizer(lambda: cluster.release(job))
    phases = {}
    began = time.monotonic()

    def text() -> str:
        return output.read_text(errors="replace") if output.exists() else ""

    def state() -> dict[str, str]:
        return cluster.job(job)

    # 1. The time limit, cut once training runs so that the script's signal is due; the stalled run waits
    # for it at step 3. Meanwhile, the one-node reference runs.
    _wait(lambda: _by_step(dump), "job's first step")
    n2_traffic = _veth_bytes("n2")
    cluster.command("scontrol", "update", f"JobId={job}", f"TimeLimit={_limit_due_now(state()['RunTime'])}")
    reference: dict[int, tuple[float, float]] = {}
    single = tmp_path / "single"

    def one_node() -> None:
        statuses, outputs = run_forked_ranks(
            ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(single), *JOB], 4, single
        )
        assert statuses == [0, 0, 0, 0], outputs[0][-3000:]
        reference.update(_by_step(single))

    reference_run = threading.Thread(target=one_node)
    reference_run.start()
    # At once: the time limit must be lifted before the requeued job starts.
    _wait(lambda: state().get("Restarts") == "1", "requeue after the time-limit signal")
    cluster.command("scontrol", "update", f"JobId={job}", "TimeLimit=10")  # the next starts run to the end
    phases["time limit"] = time.monotonic() - began
    out = text()
    assert out.count("SIGUSR1: time limit near; every rank saves and stops") == 1, out[-4000:]
    # SLURM sends the signal at its next time-limit check, which may come before the stall: at step 1 or 2.
    limited = _complete_checkpoints(dump)[-1]
    assert 1 <= limited <= STALL_STEP
    assert out.count(f"preempted: SIGUSR1 received; finished step {limited} and saved") == 4, out[-4000:]
    assert _veth_bytes("n2") - n2_traffic > 10_000_000  # the ranks' traffic crossed n2's interface

    # 2. Preemption, once the requeued run has resumed from that checkpoint and trains.
    _wait(lambda: max(_by_step(dump)) > limited, "requeued run's first step")
    assert f"checkpoint: resuming from step-{limited}" in text()
    cluster.command("scancel", "--signal=TERM", str(job))
    _wait(lambda: state().get("JobState") == "FAILED", "job end after SIGTERM", every=1)
    assert state()["ExitCode"] == "3:0"  # the preempted status, not torchrun's 1
    preempted = _complete_checkpoints(dump)[-1]
    stops = text().count(f"preempted: SIGTERM received; finished step {preempted} and saved")
    assert stops == 4, text()[-4000:]
    assert limited < preempted < STEPS
    phases["preemption"] = time.monotonic() - began
    cluster.command("scontrol", "requeue", str(job))

    # 3. A lost node, once the resumed run has published a checkpoint of its own.
    _wait(lambda: _complete_checkpoints(dump)[-1] > preempted, "a checkpoint after the preemption")
    assert f"checkpoint: resuming from step-{preempted}" in text()
    cluster.kill_node("n2")
    newest = _complete_checkpoints(dump)[-1]
    assert newest < STEPS, "the run ended before n2 could be killed"
    _wait(lambda: state().get("Restarts") == "3", "requeue after n2 went down", every=1)
    # Ranks 0 and 1 on n1 see their peers go; the first to stop makes torchrun end the other, which may not
    # get to say it (the output shows local ranks 0 and 1).
    lost = [line for line in text().splitlines() if "peer lost: rank" in line]
    assert 1 <= len(lost) <= 2, text()[-4000:]
    assert all("ranks 2, 3 are gone" in line for line in lost), lost
    assert cluster.node_states()["n2"].startswith("down")
    cluster.start_node("n2")
    _wait(lambda: state().get("JobState") == "COMPLETED", "the resumed job to finish", every=1)
    phases["lost node"] = time.monotonic() - began
    assert f"checkpoint: resuming from step-{newest}" in text()

    # slurmdbd records the end a moment after slurmctld reports it.
    _wait(lambda: "COMPLETED" in cluster.sacct(job), "the accounting record of the finished job", every=1)
    runs = cluster.sacct(job)
    print(
        f"job {job} (seconds since submission: {phases}; CPU seconds of its processes: "
        f"{cluster.cpu_seconds(job):.0f}):\n{runs}"
    )
    states = [line.split()[2] for line in runs.splitlines()[2:]]
    assert states == ["REQUEUED", "REQUEUED", "NODE_FAIL", "COMPLETED"], runs
    assert [line.split()[3] for line in runs.splitlines()[2:]] == ["0:0", "3:0", "0:0", "0:0"], runs

    # Every step, whichever run logged it last, equals the uninterrupted one-node run.
    reference_run.join(timeout=WAIT)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert max(_by_step(dump)) == STEPS
    print(
        f"stops: time limit after step {limited}, preemption after step {preempted}, n2 lost after step {newest}"
    )
    print("step  2 nodes x 2 ranks (loss, grad_norm)   1 node x 4 ranks (loss, grad_norm)")
    for step, numbers in sorted(_by_step(dump).items()):
        print(
            f"{step:4d}  {numbers[0]:.6f} {numbers[1]:.6f}                {reference[step][0]:.6f} {reference[step][1]:.6f}"
        )
    assert _by_step(dump) == reference


def test_a_config_mistake_ends_the_job_before_any_node_starts_with_one_line_and_status_2(
    cluster: Cluster, tmp_path: Path
):
    output = tmp_path / "job.out"
    env = {
        "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
        "CONFIG_FILE": str(DEBUG_CONFIG),
        "DUMP_FOLDER": str(tmp_path / "dump"),
        "LOG_DIR": str(tmp_path / "logs"),
    }
    job = cluster.sbatch(
        "--nodes=2",
        "--gpus-per-node=2",
        f"--output={output}",
        str(REPO / "apps" / "multinode_trainer.slurm"),
        *JOB,
        "--parallelism.tensor_parallel_degree",
        "3",
        env=env,
        cwd=tmp_path,
    )
    info = cluster.wait_for_job(job, {"FAILED", "COMPLETED"}, WAIT)
    print(cluster.sacct(job))
    lines = output.read_text().strip().splitlines()
    assert info["ExitCode"] == "2:0", lines
    assert len(lines) == 1 and "tp(3) * pp(1) = 3 does not divide WORLD_SIZE 4" in lines[0], lines
    assert not (tmp_path / "dump").exists()

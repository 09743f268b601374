"""Launching titan-train for the fault tests: torchrun jobs, their worker processes, and forked CLI runs.

Imported by the `test_fault_*.py` and `test_bad_inputs.py` modules (which put this folder on sys.path).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from titan_train import torchrun

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "apps" / "configs" / "debug_model.toml"

# The debug model on tiny batches: a step takes well under a second per rank on a busy 2-core machine.
TINY = (
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.disable_color_printing",
    "--lr_scheduler.warmup_steps",
    "2",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_args(dump: Path, *overrides: str) -> list[str]:
    return ["--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(dump), *TINY, *overrides]


def torchrun_command(
    dump: Path,
    *overrides: str,
    nproc: int,
    port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    max_restarts: int = 0,
) -> list[str]:
    """titan-train under torchrun with a c10d rendezvous on localhost:`port`, every rank's output tagged
    `[rankN]:`."""
    return torchrun.torchrun_command(
        "-m",
        "titan_train.cli",
        *cli_args(dump, *overrides),
        nproc=nproc,
        port=port,
        nnodes=nnodes,
        node_rank=node_rank,
        max_restarts=max_restarts,
        monitor_interval=0.5,
        tag_ranks=True,
    )


def environment() -> dict[str, str]:
    # torchrun's agent shares one TCPStore across restarts without separating the attempts' keys, so a
    # restarted gloo group can read a dead worker's address (pytorch/pytorch#135712); apps/ sets this too.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def run(command: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=environment(), cwd=REPO
    )


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(), cwd=REPO
    )


def logged_losses(dump: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl (a resumed run appends; later lines win)."""
    path = dump / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def wait_for_step(dump: Path, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while max(logged_losses(dump), default=0) < step:
        if process.poll() is not None:
            raise AssertionError(f"the run ended (status {process.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {step} within {timeout} s")
        time.sleep(0.2)


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=`rank` (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under process {launcher_pid}")


def send_signal_to_rank(launcher: subprocess.Popen, rank: int, sig: signal.Signals) -> None:
    os.kill(worker_pid(launcher.pid, rank), sig)


def rank_lines(output: str, rank: int) -> list[str]:
    """The lines torchrun tagged as coming from `rank`, without the tag."""
    tag = f"[rank{rank}]:"
    return [line[len(tag) :] for line in output.splitlines() if line.startswith(tag)]


def tree_hashes(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (proof that nothing in it changed)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


# -- titan-train in forked processes ------------------------------------------------------------------
# Importing titan-train costs several seconds of CPU per process. The bad-input table runs many short
# processes, so they are forked from one server process that imported it once (multiprocessing's
# forkserver); each is still its own process, with its own exit status, output and process group.
# Under load the forkserver can lose a child's status and report 255 for it (CPython issue 140867,
# seen once in CI on a rank that had logged its one line and returned 2), so each child also writes
# the status `main` returned beside its log, and `ForkedRun.exitcode` reads it when 255 comes back.

FORKSERVER_LOST_STATUS = 255


def _cli_process(argv: list[str], env: dict[str, str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1): a thread count changes float sums
    from titan_train.cli import main

    code = main(argv)
    Path(f"{log}.exit").write_text(f"{code}\n")
    sys.exit(code)


class ForkedRun:
    """A forked titan-train process: join, kill and its exit status (see the note above)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, log: Path):
        self.process, self.log = process, log

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        self.process.kill()

    @property
    def exitcode(self) -> int | None:
        code = self.process.exitcode
        left = Path(f"{self.log}.exit")
        if code == FORKSERVER_LOST_STATUS and left.exists():
            return int(left.read_text())
        return code


def start_forked(argv: list[str], env: dict[str, str], log: Path) -> ForkedRun:
    """`titan-train ARGV` in a process forked from the server, with `env` added; its output goes to `log`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["titan_train.cli"])
    process = context.Process(target=_cli_process, args=(argv, env, str(log)))
    process.start()
    return ForkedRun(process, log)


def start_forked_ranks(
    argv: list[str], nproc: int, logs: Path, rank_env: Callable[[int], dict[str, str]] | None = None
) -> list[ForkedRun]:
    """`nproc` forked titan-train ranks forming one process group (env:// on a free port); `rank_env(rank)`
    adds variables to one rank's environment (each rank its own data endpoint, say)."""
    port = str(free_port())
    return [
        start_forked(
            argv,
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "PYTHONUNBUFFERED": "1",
                **(rank_env(rank) if rank_env else {}),
            },
            logs / f"rank{rank}.log",
        )
        for rank in range(nproc)
    ]


def run_forked_ranks(argv: list[str], nproc: int, logs: Path, timeout: float = 300) -> tuple[list, list[str]]:
    """Run `nproc` forked ranks to the end: (exit statuses, each rank's output)."""
    logs.mkdir(parents=True, exist_ok=True)
    processes = start_forked_ranks(argv, nproc, logs)
    for process in processes:
        process.join(timeout=timeout)
    for process in processes:
        if process.exitcode is None:
            process.kill()
    return [p.exitcode for p in processes], [(logs / f"rank{rank}.log").read_text() for rank in range(nproc)]

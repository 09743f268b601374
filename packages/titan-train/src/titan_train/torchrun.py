"""Real multi-process jobs on this machine: the torchrun command line, and a run of it to the end.

Tests and benchmarks that need real process groups (gloo on CPU) launch through these two functions
rather than each writing `python -m torch.distributed.run ...` of its own. The rendezvous is c10d on
localhost: port 0 lets torchrun pick a free one; jobs that meet across several torchrun "nodes",
or must be found again after a restart, name a port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun_command(
    *target: str,
    nproc: int,
    port: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    max_restarts: int = 0,
    monitor_interval: float | None = None,
    tag_ranks: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """`python -m torch.distributed.run` starting `target` (a script and its arguments, or "-m", a module
    and its arguments) on `nproc` ranks of node `node_rank` of `nnodes`.

    `max_restarts` lets torchrun restart the whole group that many times (checked every
    `monitor_interval` seconds, torchrun's default when None); `tag_ranks` prefixes every line a
    rank prints with `[rankN]:`.
    """
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
    ]
    if port:
        command += ["--rdzv-id", f"titan-{port}"]
    command += ["--max-restarts", str(max_restarts)]
    if monitor_interval is not None:
        command += ["--monitor-interval", str(monitor_interval)]
    if tag_ranks:
        command += ["--role", "rank", "--tee", "3"]
    return [*command, *target]


def run_torchrun(
    *target: str,
    nproc: int,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    **options,
) -> subprocess.CompletedProcess:
    """Run `torchrun_command(*target, nproc=nproc, **options)` to the end and return it, output captured.

    Each rank runs one torch thread (OMP_NUM_THREADS=1: what torchrun sets anyway, said here so that
    it does not warn), so that ranks sharing a few cores do not oversubscribe them, and a rank that
    crashes in native code prints every thread's Python stack (PYTHONFAULTHANDLER); `env` adds to or
    overrides this process's environment.
    """
    return subprocess.run(
        torchrun_command(*target, nproc=nproc, **options),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})},
        cwd=cwd,
    )

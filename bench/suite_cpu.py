"""Where the test suite's CPU goes, per test file: the figure CI's 2-core time limit depends on.

The suite is CPU-bound on CI's 2 cores (3 workers, never idle), so its wall time is its CPU time over about
1.85 (measured by cgroup, 2026-11-29); wall-clock durations under that load do not say which file costs what. As a pytest plugin this
records, per test, the CPU-seconds of everything the test ran:

    TITAN_SUITE_CPU=/tmp/cpu PYTHONPATH=bench uv run pytest -p suite_cpu -n 3 --dist loadfile
    uv run python bench/suite_cpu.py /tmp/cpu          # the table, costliest file first

(as `.ci/run` runs it: add TITAN_FLOOR_TORCH=2.11.0 TITAN_FLOOR_TORCHAO=0.17.0).

Where the cgroup v1 `cpuacct` controller is writable (root on a VM), each worker moves into a cgroup of its
own and a test's figure is that cgroup's usage: every process the test started counts, also those no one
waits for (forkserver pools, daemons such as SLURM's). Elsewhere it is the worker's rusage and that of the
processes it waited for (torchrun launchers and ranks, subprocesses, a floor check's library run), which
misses forkserver children: measured 2026-11-29, test_dry_run.py 53 CPU-s by rusage, 177 alone by the machine's
busy time.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_group: Path | None = None


def _own_cgroup() -> Path | None:
    """A cpuacct cgroup holding this process (and so everything it starts), or None where none can be made."""
    group = CPUACCT / f"titan-suite-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return group
    except OSError:
        return None


def pytest_configure(config):
    global _group
    if os.environ.get("TITAN_SUITE_CPU"):
        _group = _own_cgroup()


def _cpu_seconds() -> tuple[float, float, float | None]:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    group = int((_group / "cpuacct.usage").read_text()) / 1e9 if _group else None
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime, group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, waited, group = _cpu_seconds()
    start = time.time()
    yield
    own_after, waited_after, group_after = _cpu_seconds()
    record = {
        "id": item.nodeid,
        "self": own_after - own,
        "children": waited_after - waited,
        "wall": time.time() - start,
    }
    if group is not None:
        record["cgroup"] = group_after - group
    folder = Path(os.environ.get("TITAN_SUITE_CPU", "suite_cpu"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def report(folder: Path, rows: int = 40) -> None:
    records = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    own, waited, whole, tests = (collections.Counter() for _ in range(4))
    for record in records:
        name = record["id"].split("::")[0]
        own[name] += record["self"]
        waited[name] += record["children"]
        whole[name] += record.get("cgroup", record["self"] + record["children"])
        tests[name] += 1
    total = sum(whole.values())
    print(f"{len(records)} tests, {total / 60:.1f} CPU-minutes ({sum(own.values()) / 60:.1f} in the workers)")
    print(f"{'CPU-s':>7} {'share':>6} {'worker':>7} {'waited':>7} {'tests':>6}  file")
    for name in sorted(tests, key=lambda n: -whole[n])[:rows]:
        cpu = whole[name]
        print(f"{cpu:7.0f} {cpu / total:6.1%} {own[name]:7.0f} {waited[name]:7.0f} {tests[name]:6d}  {name}")


if __name__ == "__main__":
    report(Path(sys.argv[1]), rows=int(sys.argv[2]) if len(sys.argv) > 2 else 40)

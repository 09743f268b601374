"""Where the test suite's CPU goes, per test file: the figure CI's 2-core time limit depends on.

The suite is CPU-bound on CI's 2 cores (3 workers, never idle), so its wall time is its CPU time over about
1.7; wall-clock durations under that load do not say which file costs what. As a pytest plugin this
records, per test, the CPU-seconds of the worker and of the processes the test started and waited for
(torchrun launchers and their ranks, subprocesses, a floor check's whole library run):

    TITAN_SUITE_CPU=/tmp/cpu PYTHONPATH=bench uv run pytest -p suite_cpu -n 3 --dist loadfile
    uv run python bench/suite_cpu.py /tmp/cpu          # the table, costliest file first

(as `.ci/run` runs it: add TITAN_FLOOR_TORCH=2.11.0 TITAN_FLOOR_TORCHAO=0.17.0).
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


def _cpu_seconds() -> tuple[float, float]:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, waited = _cpu_seconds()
    start = time.time()
    yield
    own_after, waited_after = _cpu_seconds()
    record = {
        "id": item.nodeid,
        "self": own_after - own,
        "children": waited_after - waited,
        "wall": time.time() - start,
    }
    folder = Path(os.environ.get("TITAN_SUITE_CPU", "suite_cpu"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def report(folder: Path, rows: int = 40) -> None:
    records = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    own, waited, tests = collections.Counter(), collections.Counter(), collections.Counter()
    for record in records:
        name = record["id"].split("::")[0]
        own[name] += record["self"]
        waited[name] += record["children"]
        tests[name] += 1
    total = sum(own.values()) + sum(waited.values())
    print(f"{len(records)} tests, {total / 60:.1f} CPU-minutes ({sum(own.values()) / 60:.1f} in the workers)")
    print(f"{'CPU-s':>7} {'share':>6} {'worker':>7} {'started':>8} {'tests':>6}  file")
    for name in sorted(tests, key=lambda n: -(own[n] + waited[n]))[:rows]:
        cpu = own[name] + waited[name]
        print(f"{cpu:7.0f} {cpu / total:6.1%} {own[name]:7.0f} {waited[name]:8.0f} {tests[name]:6d}  {name}")


if __name__ == "__main__":
    report(Path(sys.argv[1]))

"""A short soak in CI: bench/soak.py for 1,500 tiny steps with async checkpoints every 100 steps, validation
and TensorBoard, failing on a resident-memory, thread or file-descriptor climb after step 500.

The full soak (6,000 steps, bench/RESULTS.md) is the benchmark; this one is short enough for CI and still
long enough to see the leak the soak first found: with the trainer's scheduled garbage collections of
the young generations only (a planted `gc.collect(1)` in titan_train/step/gc_schedule.py), resident
memory grew 5.5 MiB per 1,000 steps here against 0.3 without (1.1 in one CI run: a fit over 1,000 steps
is noisier than the full soak's), so this soak allows 3 MiB per 1,000 steps and exits 1 above. Open fds
and threads may grow by 2 per 1,000 steps (soak.py's default): a planted descriptor left open per
checkpoint save grew them by 10 and failed it; one CI run's stray late descriptor fitted as +0.18.
"""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_finds_no_leak():
    command = [
        sys.executable,
        str(REPO / "bench" / "soak.py"),
        "--steps",
        "1500",
        "--warmup-steps",
        "500",
        "--checkpoint-interval",
        "100",
        "--validation-freq",
        "100",
        "--max-growth-mib",
        "3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "growth after step 500: rss_mib" in out and "1,500 steps in" in out, out[-3000:]

"""FSDP through titan-parallel's public API, on real gloo process groups, against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "fsdp_train.py"


def _run(world: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(WORKER), str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp_on_two_ranks_matches_one_process(tmp_path):
    single = _run(1, tmp_path / "one.json")
    sharded = _run(2, tmp_path / "two.json")
    for a, b in zip(single, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)

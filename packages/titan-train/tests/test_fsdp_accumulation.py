"""Gradient accumulation under FSDP on two real gloo ranks: same losses, one reduce-scatter per step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "fsdp_accumulation.py"


@pytest.mark.slow
def test_fsdp_accumulation_matches_the_whole_batch_and_reduces_gradients_once_per_step(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(WORKER), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    runs = json.loads(out.read_text())
    whole, accumulated = runs["local_batch_4"], runs["local_batch_2_accumulate_2"]
    assert whole["fsdp"] and accumulated["fsdp"]
    assert (whole["grad_accum_steps"], accumulated["grad_accum_steps"]) == (1, 2)
    assert len(set(whole["losses"])) == 3
    assert accumulated["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    # One reduction per FSDP group per step in both runs: the first micro-batch's gradients stayed local.
    assert whole["reductions"] > 0
    assert accumulated["reductions"] == whole["reductions"]

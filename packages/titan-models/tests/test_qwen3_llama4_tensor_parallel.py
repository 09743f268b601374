"""The Qwen3 and Llama 4 tensor-parallel plans (QK norms split by head, MoE replicated) on 2 real gloo
ranks: initial weights, logits, loss and every gradient equal to one process's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "qwen3_llama4_tp_worker.py"


@pytest.mark.slow
def test_tp_plans_forward_and_backward_equal_one_process(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(WORKER), str(out)]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for case, r in json.loads(out.read_text()).items():
        assert r["sharded_heads"], case
        assert r["init"] == 0.0, case
        assert r["logits"] < 1e-5 and r["loss"] < 1e-5, (case, r)
        assert r["grads"] < 1e-5, (case, r["worst_grad"], r["grads"])

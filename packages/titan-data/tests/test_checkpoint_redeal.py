"""The loader state through a real distributed checkpoint: saved by 2 gloo ranks, each writing its own
streams' entries, and loaded by 3 ranks and by 1, which read on exactly where the 2 stopped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_data import PackedTokenDataset, StreamLayout, TokenLoader, get_source

WORKER = Path(__file__).parent / "workers" / "dcp_redeal.py"
NUM_STREAMS, GLOBAL_BATCH, SEQ_LEN, SAVED_STEPS, RESUMED_STEPS = 12, 12, 32, 3, 4


def _global_steps(out: Path, phase: str, world: int) -> list[list[tuple]]:
    per_rank = [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(world)]
    return [
        sorted(tuple(w) for batches in per_rank for w in batches[step]) for step in range(len(per_rank[0]))
    ]


@pytest.mark.slow
def test_state_saved_by_two_ranks_resumes_on_three_and_on_one(tmp_path, llama3_tokenizer):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=3",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(tmp_path),
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]

    dataset = PackedTokenDataset(
        get_source("c4_test"), llama3_tokenizer, SEQ_LEN, streams=StreamLayout(num_streams=NUM_STREAMS)
    )
    it = iter(TokenLoader(dataset, GLOBAL_BATCH))
    expected = []
    for _ in range(SAVED_STEPS + RESUMED_STEPS):
        inputs, labels = next(it)
        expected.append(sorted(tuple(w) for w in torch.cat([inputs, labels[:, -1:]], dim=1).tolist()))

    assert _global_steps(tmp_path, "saved", 2) == expected[:SAVED_STEPS]
    for world in (3, 1):
        assert _global_steps(tmp_path, f"world{world}", world) == expected[SAVED_STEPS:], (
            f"resumed on {world} ranks"
        )

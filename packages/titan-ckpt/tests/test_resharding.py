"""Checkpoints across layouts and ranks, on a real 2-rank gloo group launched with torchrun (one launch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "reshard_worker.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard") / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fsdp_2_rank_checkpoint_loads_into_1_rank_with_identical_weights(report):
    assert report["fsdp_is_sharded"]
    assert report["one_rank_weights_max_diff"] == 0.0
    assert report["one_rank_optimizer_max_diff"] == 0.0
    # Each rank saved its own stream position side by side; one rank now owns both.
    assert report["one_rank_streams"] == {"0": 3, "1": 3}


@pytest.mark.slow
def test_fsdp_2_rank_checkpoint_loads_into_tensor_parallel_2_with_identical_weights(report):
    assert report["tp_is_sharded"]
    assert report["tp_weights_max_diff"] == 0.0
    assert report["tp_optimizer_max_diff"] == 0.0


@pytest.mark.slow
def test_async_saves_across_ranks_hold_the_state_of_their_step(report):
    assert report["async_max_diff"] == {"async": 0.0, "async_with_pinned_mem": 0.0}


@pytest.mark.slow
def test_a_rank_failing_mid_write_publishes_nothing_and_the_next_start_skips_it(report):
    assert all("saving" in e and "step-2.partial failed" in e for e in report["failed_save_errors"])
    assert report["failed_save_folders"] == ["step-1", "step-2.partial"]
    assert report["after_failure_load"] == 1
    assert report["after_failure_folders"] == ["step-1"]


@pytest.mark.slow
def test_a_key_missing_on_one_rank_fails_on_every_rank_with_its_name(report):
    first, second = report["mismatch_errors"]
    assert first == second
    assert "has no key 'dataloader.stream_5'" in first


@pytest.mark.slow
def test_hf_export_from_fsdp_imports_into_tensor_parallel_exactly(report):
    assert report["hf_files"] == [  # beside the full DCP state of the last step
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "config.json",
        "model-00001-of-00002.safetensors",  # each rank writes the file of the tensors it was given
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert report["hf_tp_max_diff"] == 0.0


@pytest.mark.slow
def test_float8_block_quantised_hf_files_load_dequantised_into_fsdp_and_tensor_parallel(report):
    # Each rank keeps exactly the rows (FSDP, column-wise TP) or columns (row-wise TP) of fp8 * scale.
    assert report["hf_fp8_max_diff"] == {"fsdp": 0.0, "tp": 0.0}
    assert report["hf_fp8_quantisation_error"] > 1e-3  # the files are float8, not the originals


@pytest.mark.slow
def test_mxfp4_expert_weights_load_decoded_into_every_split_of_an_expert_tensor(report):
    """gpt-oss's published MXFP4 experts into a tensor whole, split by expert (FSDP, EP), by column across a
    32-value group (48 of 96) and by row: each rank's part equals the values the codes and exponents mean,
    decoded element by element in the worker from the E2M1 table. Planted: a column part read from its first
    group's start instead of its offset in it failed the columns split."""
    assert report["hf_mxfp4_max_diff"] == {"whole": 0.0, "experts": 0.0, "columns": 0.0, "rows": 0.0}
    assert report["hf_mxfp4_local_shapes"] == {
        "whole": [4, 96, 6],
        "experts": [2, 96, 6],
        "columns": [4, 48, 6],
        "rows": [4, 96, 3],
    }

"""titan-train end to end on one GPU: NCCL, bf16 autocast, compile, float8, memory snapshots and MFU.

Each test launches its own run of the debug config (apps/configs/debug_model.toml: llama3
debugmodel on the bundled c4_test data, seq 256, batch 8) in a fresh process, with
`python -m titan_train.cli`, or under `python -m torch.distributed.run` where the launcher matters.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_train.torchrun import torchrun_command

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = REPO / "apps" / "configs" / "debug_model.toml"
LOGGED_EVERY_STEP = (
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.disable_color_printing",
)


def _titan_train(dump: Path, *overrides: str, torchrun: bool = False) -> tuple[str, list[dict]]:
    """Run titan-train to completion; its output and its metrics.jsonl records."""
    target = [
        "-m",
        "titan_train.cli",
        "--job.config_file",
        str(DEBUG_CONFIG),
        "--job.dump_folder",
        str(dump),
        *LOGGED_EVERY_STEP,
        *overrides,
    ]
    command = torchrun_command(*target, nproc=1) if torchrun else [sys.executable, *target]
    # At INFO, torch logs each ProcessGroupNCCL it creates ("ProcessGroupNCCL initialization options").
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "INFO"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return output, records


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_titan_train_with_nccl_at_world_size_one_learns_and_reports_gpu_memory(tmp_path, report):
    # One GPU has no FSDP to cast parameters: bf16 mixed precision runs as autocast (build.forward_context).
    bf16_autocast = ("--training.dtype", "float32", "--training.mixed_precision_param", "bfloat16")
    output, records = _titan_train(tmp_path, "--training.steps", "20", *bf16_autocast, torchrun=True)
    losses = _losses(records)
    report(
        first_loss=losses[0],
        last_loss=losses[-1],
        memory_gib=records[-1]["memory_gib"],
        tps=records[-1]["tps"],
    )
    assert "ProcessGroupNCCL initialization options" in output, "the run's log shows no NCCL process group"
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all(r["memory_gib"] > 0 for r in records)
    assert losses[0] > 7.0  # about ln(2048) at the start
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0


def test_titan_train_with_compile_finishes_and_learns(tmp_path, report):
    output, records = _titan_train(tmp_path, "--training.steps", "10", "--compile.enable")
    losses = _losses(records)
    report(first_loss=losses[0], last_loss=losses[-1], tps=records[-1]["tps"])
    assert "compiled 6 blocks with inductor" in output
    assert [r["step"] for r in records] == list(range(1, 11))
    assert losses[-1] < losses[0]


def test_titan_train_with_float8_finishes_and_learns(tmp_path, float8_gpu, report):
    output, records = _titan_train(tmp_path, "--training.steps", "10", "--model.converters", "float8")
    losses = _losses(records)
    report(first_loss=losses[0], last_loss=losses[-1], tps=records[-1]["tps"])
    converted = re.search(r"float8 tensorwise: (\d+) linear layers converted", output)
    assert converted and int(converted.group(1)) == 6 * 7, output[-4000:]  # every block linear
    assert [r["step"] for r in records] == list(range(1, 11))
    assert losses[-1] < losses[0]


def test_titan_train_writes_a_loadable_cuda_memory_snapshot(tmp_path):
    _titan_train(
        tmp_path,
        "--training.steps",
        "4",
        "--profiling.enable_memory_snapshot",
        "--profiling.profile_freq",
        "4",
    )
    path = tmp_path / "memory_snapshot" / "iteration_4" / "rank0_memory_snapshot.pickle"
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snapshot), sorted(snapshot)
    assert snapshot["segments"], "the allocator held no memory while the model trained"
    assert any(snapshot["device_traces"]), "no allocation was recorded"


def test_peak_flops_of_an_h100_sxm_is_its_dense_bf16_datasheet_value():
    from titan_train.reporting.device_peaks import peak_flops

    name = torch.cuda.get_device_name()
    if name != "NVIDIA H100 80GB HBM3":
        pytest.skip(f"checks the H100 SXM's peak; this GPU is {name!r}")
    assert peak_flops(torch.device("cuda")) == 989.4e12


def test_titan_train_logs_mfu_against_the_device_peak(tmp_path, report):
    from titan_train.reporting.device_peaks import peak_flops

    peak = peak_flops(torch.device("cuda"))
    if peak is None:
        pytest.skip(f"no peak FLOP/s is listed for {torch.cuda.get_device_name()!r}, so no MFU")
    _, records = _titan_train(tmp_path, "--training.steps", "3")
    report(mfu=records[-1]["mfu"], tflops=records[-1]["tflops"])
    for r in records:
        assert r["mfu"] is not None and r["mfu"] > 0, r
        assert r["mfu"] == pytest.approx(100 * r["tflops"] * 1e12 / peak, rel=1e-9), r

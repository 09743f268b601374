"""Qwen3.5 under two-rank layouts (gloo ranks through torchrun) and in one process with activation
checkpointing or compile trains as the plain one-process run: CP 2 on the causal debug flavor (the linear
layers gathering the whole sequence, full attention torch's ring attention), FSDP 2, TP 2 and PP 2 (1F1B)
on the packed debug flavor (block-causal rows, so the linear layers restart at every document), EP 2 (with FSDP 2) on the MoE
debug flavor; the same global batch of 4 rows dealt from 4 streams, loss and grad_norm within 1e-5
relative of one process at every step."""

from __future__ import annotations

import json

import pytest

from titan_train.cli import run
from titan_train.torchrun import run_torchrun

pytestmark = pytest.mark.timeout(1800)

FLAGS = (
    *("--model.name", "qwen3_5", "--training.seq_len", "48"),
    *("--training.steps", "3", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--metrics.disable_color_printing"),
    *("--training.dataloader.num_streams", "4", "--metrics.enable_tensorboard", "false"),
)
P = "--parallelism."
PACKED, MOE = "debugmodel_flex_attn", "debugmodel_moe"
# name -> (flavor, ranks, per-rank batch, flags)
LAYOUTS = {
    "fsdp2": (PACKED, 2, "2", (f"{P}data_parallel_shard_degree", "2")),
    "cp2": (
        "debugmodel",
        2,
        "4",
        (f"{P}context_parallel_degree", "2", f"{P}context_parallel_rotate_method", "allgather"),
    ),
    "tp2": (PACKED, 2, "4", (f"{P}tensor_parallel_degree", "2")),
    "pp2": (PACKED, 2, "4", (f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", "1F1B")),
    "ep2": (MOE, 2, "2", (f"{P}data_parallel_shard_degree", "2", f"{P}expert_parallel_degree", "2")),
    "ac_full": (PACKED, 1, "4", ("--activation_checkpoint.mode", "full")),
    "compile": (PACKED, 1, "4", ("--compile.enable",)),
}


def _metrics(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """flavor -> the plain one-process run's metrics (batch 4)."""
    runs = {}
    for flavor in (PACKED, MOE, "debugmodel"):
        dump = tmp_path_factory.mktemp(f"one_{flavor}")
        assert (
            run(
                [
                    "--job.dump_folder",
                    str(dump),
                    *FLAGS,
                    "--model.flavor",
                    flavor,
                    "--training.local_batch_size",
                    "4",
                ]
            )
            == 0
        )
        runs[flavor] = _metrics(dump)
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen3_5_under_a_layout_trains_as_one_process(name, one_process, tmp_path):
    flavor, ranks, batch, layout = LAYOUTS[name]
    flags = ["--job.dump_folder", str(tmp_path), *FLAGS, "--model.flavor", flavor]
    flags += ["--training.local_batch_size", batch, *layout]
    if ranks == 1:
        assert run(flags) == 0
    else:
        result = run_torchrun("-m", "titan_train.cli", *flags, nproc=ranks, timeout=900)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    one, got = one_process[flavor], _metrics(tmp_path)
    assert [r["step"] for r in one] == [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(one, got, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])

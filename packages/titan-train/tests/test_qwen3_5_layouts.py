"""Qwen3.5 under two-rank layouts (gloo ranks through torchrun) trains as one process: FSDP 2 and PP 2
(1F1B) on the packed debug flavor (block-causal rows, so the linear layers restart at every document), EP 2
(with FSDP 2) on the MoE debug flavor; the same global batch of 4 rows dealt from 4 streams, loss and
grad_norm within 1e-5 relative of one process at every step."""

from __future__ import annotations

import json

import pytest

from titan_train.cli import run
from titan_train.torchrun import run_torchrun

pytestmark = pytest.mark.timeout(1200)

FLAGS = (
    *("--model.name", "qwen3_5", "--training.seq_len", "48"),
    *("--training.steps", "3", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--metrics.disable_color_printing"),
    *("--training.dataloader.num_streams", "4", "--metrics.enable_tensorboard", "false"),
)


def _metrics(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


P = "--parallelism."
PACKED = "debugmodel_flex_attn"
LAYOUTS = {
    # (flavor, per-rank batch, flags)
    "fsdp2": (PACKED, "2", (f"{P}data_parallel_shard_degree", "2")),
    "pp2": (PACKED, "4", (f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", "1F1B")),
    "ep2": (
        "debugmodel_moe",
        "2",
        (f"{P}data_parallel_shard_degree", "2", f"{P}expert_parallel_degree", "2"),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen3_5_under_a_two_rank_layout_trains_as_one_process(name, tmp_path):
    flavor, batch, layout = LAYOUTS[name]
    common = [*FLAGS, "--model.flavor", flavor]
    assert run(["--job.dump_folder", str(tmp_path / "one"), *common, "--training.local_batch_size", "4"]) == 0
    flags = [
        "--job.dump_folder",
        str(tmp_path / "two"),
        *common,
        "--training.local_batch_size",
        batch,
        *layout,
    ]
    result = run_torchrun("-m", "titan_train.cli", *flags, nproc=2, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])

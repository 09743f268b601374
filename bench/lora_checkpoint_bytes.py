"""Bytes of a LoRA run's periodic checkpoint with and without the frozen base (`lora.save_adapter_only`).

Each mode trains the llama3 debug model (apps/configs/debug_lora.toml: all-linear adapters, rank 8) for two
steps in a fresh `titan-train` process with a checkpoint at every step, and the table shows the size on disk
of step-1 (a periodic save: model or adapters, optimizer, learning-rate, data and step state) and of step-2
(the last save, which always holds the whole model).

    uv run python bench/lora_checkpoint_bytes.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = (
    "--job.config_file", str(REPO / "apps" / "configs" / "debug_lora.toml"),
    "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
    "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
)  # fmt: skip
MODES = {"adapter-only (default)": "true", "whole model (save_adapter_only = false)": "false"}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    rows = []
    for mode, flag in MODES.items():
        with tempfile.TemporaryDirectory() as dump:
            command = [sys.executable, "-m", "titan_train.cli", "--job.dump_folder", dump, *FLAGS]
            done = subprocess.run(
                [*command, "--lora.save_adapter_only", flag], capture_output=True, text=True, cwd=REPO
            )
            if done.returncode != 0:
                raise SystemExit(f"{mode}: titan-train failed:\n{done.stderr[-3000:]}")
            folder = Path(dump) / "checkpoint"
            rows.append((mode, _bytes(folder / "step-1"), _bytes(folder / "step-2")))
    full = rows[1][1]
    print(
        "| periodic save (step-1) | step-1 bytes | share of a whole-model save | last save (step-2) bytes |"
    )
    print("|---|---:|---:|---:|")
    for mode, periodic, last in rows:
        print(f"| {mode} | {periodic:,} | {periodic / full:.4f} | {last:,} |")


if __name__ == "__main__":
    main()

"""`titan-train` with the CUDA allocator's peaks of this process written, as JSON, to $TITAN_PEAK_OUT.

bench/memory_vs_gpu.py and bench/gpu_recipes.py launch it under torchrun (one rank, `launch`) to measure what
a real run holds: `torch.cuda.max_memory_allocated`, `max_memory_reserved` and the peak active bytes, over
the run.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_train.cli import main


def _write_peaks() -> None:
    if not torch.cuda.is_initialized():
        return
    stats = torch.cuda.memory_stats()
    peaks = {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "active": stats.get("active_bytes.all.peak", 0),
    }
    Path(os.environ["TITAN_PEAK_OUT"]).write_text(json.dumps(peaks))


@dataclass
class PeakRun:
    """What one launched run left: its exit status and output, the allocator's peaks (None where the run
    never used CUDA) and the records of its metrics.jsonl."""

    returncode: int
    text: str
    peaks: dict | None
    records: list[dict]


def launch(flags: list[str], env: dict[str, str], log: Path | None = None) -> PeakRun:
    """`titan-train` with `flags` under torchrun on one rank, with a scratch dump folder; its output kept
    in `log` when given."""
    from train_throughput import _torchrun  # bench/ is the caller's folder

    with tempfile.TemporaryDirectory() as tmp:
        peaks = Path(tmp) / "peaks.json"
        proc = subprocess.run(
            [*_torchrun(1), __file__, *flags, "--job.dump_folder", f"{tmp}/dump"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            env={**env, "TITAN_PEAK_OUT": str(peaks)},
        )
        text = proc.stdout + proc.stderr
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(text)
        metrics = Path(tmp) / "dump/metrics.jsonl"
        return PeakRun(
            proc.returncode,
            text,
            json.loads(peaks.read_text()) if peaks.exists() else None,
            [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else [],
        )


if __name__ == "__main__":
    atexit.register(_write_peaks)
    sys.exit(main())

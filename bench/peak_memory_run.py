"""`titan-train` with the CUDA allocator's peaks of this process written, as JSON, to $TITAN_PEAK_OUT.

bench/memory_vs_gpu.py launches it under torchrun (one rank) to measure what a real run holds:
`torch.cuda.max_memory_allocated`, `max_memory_reserved` and the peak active bytes, over the run.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
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


if __name__ == "__main__":
    atexit.register(_write_peaks)
    sys.exit(main())

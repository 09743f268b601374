"""torchrun worker of bench/hf_export_memory.py: `titan-train ARGS` with the RSS of the HF export and import sampled.

Registers `bench_1gb` for llama3 and qwen3 (about 1 GB of fp32 parameters at HF_EXPORT_BENCH_SCALE 1.0;
the scale sets the number of blocks), wraps the checkpointer's export and import in a sampler of
/proc/self/statm, runs the CLI and appends one JSON line per rank and phase to HF_EXPORT_BENCH_RECORD.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from dataclasses import replace

import torch

import titan_ckpt.checkpointer as checkpointer
from titan_models import qwen3
from titan_train.cli import run
from titan_train.registry import get_model_family, register_flavor

SCALE = float(os.environ["HF_EXPORT_BENCH_SCALE"])
RECORD = os.environ["HF_EXPORT_BENCH_RECORD"]
PAGE = os.sysconf("SC_PAGE_SIZE")

LLAMA = get_model_family("llama3").args_for(
    "debugmodel", dim=1024, n_layers=max(2, round(20 * SCALE)), n_heads=16, n_kv_heads=16
)
QWEN = replace(
    qwen3.QWEN3_FLAVORS["debugmodel_moe"],
    dim=512,
    n_layers=max(2, round(12 * SCALE)),
    n_heads=8,
    n_kv_heads=4,
    head_dim=128,
    moe_inter_dim=768,
    moe_args=qwen3.qwen3_moe_args(16, 2),
)
register_flavor("llama3", "bench_1gb", LLAMA)
register_flavor("qwen3", "bench_1gb", QWEN)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _model_bytes() -> int:
    name = sys.argv[sys.argv.index("--model.name") + 1]
    family = get_model_family(name)
    with torch.device("meta"):
        model = family.build(LLAMA if name == "llama3" else QWEN)
    return sum(p.numel() * 4 for p in model.parameters())


def sampled(what: str, fn):
    """`fn` with its peak RSS recorded (sampled every 2 ms, and once at the end)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before, peak, stop = _rss(), [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss())
                stop.wait(0.002)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            return fn(*args, **kwargs)
        finally:
            peak[0] = max(peak[0], _rss())
            stop.set()
            thread.join()
            line = {
                "what": what,
                "rank": int(os.environ["RANK"]),
                "before": before,
                "peak": peak[0],
                "model_bytes": _model_bytes(),
            }
            with open(RECORD, "a") as f:
                f.write(json.dumps(line) + "\n")

    return wrapper


checkpointer.Checkpointer._write_hf = sampled("export", checkpointer.Checkpointer._write_hf)
checkpointer.load_hf_weights = sampled("import", checkpointer.load_hf_weights)

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

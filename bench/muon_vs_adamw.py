"""Muon against AdamW: step time, peak memory, and where Muon's optimizer step spends its time.

Each row trains with `titan-train` (torchrun, gloo, CPU, one torch thread a rank) for a few steps and
reads the run's own records: `metrics.jsonl` (step time of the steps after the first, peak resident
memory of rank 0, `ru_maxrss`) and Muon's log line (`muon: to step N: optimizer steps ... s,
Newton-Schulz X%, gathering matrices whole Y%`), which times the optimizer steps since the last log.
Shapes: the llama3 debug model, and Llama 3.2 1B's blocks cut to 2 of its 16 (`1B_2layers`, registered
by this script's flavor module: the whole 1B does not train in reasonable time on a 2-core CPU; a
block's matrices, which Muon orthogonalises, are the 1B's own). Layouts: one process, and FSDP over 2
ranks (debug shape), where every matrix is gathered whole before Newton-Schulz.

    uv run python bench/muon_vs_adamw.py [--steps 3] [--rows debug:1,debug:2,1B_2layers:1]

Newton-Schulz runs in bfloat16 (as torch.optim.Muon's), which this CPU computes far slower than float32:
the script first measures its rate and prints what a 1B block's matrices would take, which is why the
1B cut is not among the default rows here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from titan_train.torchrun import run_torchrun

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SHAPES = {
    "debug": ("--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "4"),
    "1B_2layers": ("--model.flavor", "1B_2layers", "--training.seq_len", "128", "--training.local_batch_size", "1"),
}  # fmt: skip
COMMON = (
    "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1",
    "--optimizer.implementation", "foreach", "--metrics.disable_color_printing",
    "--experimental.custom_import", "muon_bench_flavors",
)  # fmt: skip
LOG = re.compile(
    r"muon: to step (\d+): optimizer steps ([\d.]+) s, Newton-Schulz (\d+)%, gathering matrices whole (\d+)%"
)


def run(shape: str, optimizer: str, nproc: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--job.dump_folder", tmp, *COMMON, *SHAPES[shape], "--training.steps", str(steps)]
        flags += ["--optimizer.name", optimizer]
        if nproc > 1:  # the same global batch as one process
            per_rank = int(SHAPES[shape][-1]) // nproc
            flags += ["--training.local_batch_size", str(max(per_rank, 1))]
        env = {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])),
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16",  # Newton-Schulz's bfloat16 matmuls: no AMX kernel here
        }
        done = run_torchrun("-m", "titan_train.cli", *flags, nproc=nproc, timeout=3600, env=env, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    later = records[1:] or records
    row = {
        "step_s": sum(r["step_time_s"] for r in later) / len(later),
        "peak_gib": max(r["memory_gib"] for r in records),
    }
    timed = [m for m in LOG.finditer(done.stdout + done.stderr) if int(m.group(1)) > 1]
    if timed:
        row["optimizer_s"] = sum(float(m.group(2)) for m in timed) / len(timed)
        row["ns_pct"] = sum(int(m.group(3)) for m in timed) / len(timed)
        row["gather_pct"] = sum(int(m.group(4)) for m in timed) / len(timed)
    return row


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Multiply-adds x 2 of `steps` quintic iterations on a rows x cols matrix (made wide: n <= m)."""
    n, m = sorted((rows, cols))
    return steps * 2 * (n * n * m + n * n * n + n * n * m)


def newton_schulz_rate() -> float:
    """FLOP/s of Newton-Schulz (bfloat16, one thread) on a debug-model matrix, measured here."""
    import time

    import torch

    from titan_parallel import newton_schulz

    torch.set_num_threads(1)
    g = torch.randn(768, 256)
    newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
    start = time.perf_counter()
    for _ in range(3):
        newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
    return 3 * newton_schulz_flops(768, 256) / (time.perf_counter() - start)


# Llama 3.2 1B's block matrices: wq, wo (2048 x 2048), wk, wv (512 x 2048), w1, w3 (8192 x 2048), w2.
ONE_B_BLOCK = [(2048, 2048)] * 2 + [(512, 2048)] * 2 + [(8192, 2048)] * 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--rows",
        default="debug:1,debug:2,1B_2layers:1",
        help="shape:ranks, comma-separated (2 ranks: FSDP 2)",
    )
    a = parser.parse_args()
    print(
        "| shape | layout | optimizer | step (s) | peak RSS rank 0 (GiB) | Muon step (s) | Newton-Schulz | gathers |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape, nproc in (item.split(":") for item in a.rows.split(",")):
        for optimizer in ("AdamW", "Muon"):
            r = run(shape, optimizer, int(nproc), a.steps)
            layout = "1 process" if nproc == "1" else f"FSDP {nproc}"
            muon = (
                f"{r['optimizer_s']:.3f} | {r['ns_pct']:.0f}% | {r['gather_pct']:.0f}%"
                if "optimizer_s" in r
                else "- | - | -"
            )
            print(f"| {shape} | {layout} | {optimizer} | {r['step_s']:.2f} | {r['peak_gib']:.2f} | {muon} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

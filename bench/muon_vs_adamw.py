"""Muon against AdamW: step time, peak memory, and where Muon's optimizer step spends its time.

Each trained row runs `titan-train` (torchrun, gloo, CPU, one torch thread a rank) for a few steps and
reads the run's own records: `metrics.jsonl` (step time of the steps after the first, peak resident
memory of rank 0, `ru_maxrss`) and Muon's log line (`muon: to step N: optimizer steps ... s,
Newton-Schulz X% (M matrices on this rank), gathering matrices whole Y%, scattering them back Z%`), which
times the optimizer steps since the last log; each row is printed beside AdamW's with the ratio.
Layouts: one process, and FSDP over 2 ranks, where the split matrices are shared out between the ranks.

Shapes: the llama3 debug model; Llama 3.2 1B (`1B`) and its blocks cut to 2 of 16 (`1B_2layers`, this
script's flavor module). Newton-Schulz runs in bfloat16 (as torch.optim.Muon's), which a CPU without
bfloat16 instructions computes at about 1 GFLOP/s: the script first measures that rate and prints what
the 1B's matrices would take a step (hours), so the 1B is not trained by default; its memory, Muon against
AdamW, comes from the dry run (`--traced`: one step traced on fake tensors, rank 0's peak allocated).

    uv run python bench/muon_vs_adamw.py [--steps 3] [--rows debug:1,debug:2] [--traced 1B:1,1B:2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_train.torchrun import run_torchrun

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SHAPES = {
    "debug": ("--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "4"),
    "1B_2layers": ("--model.flavor", "1B_2layers", "--training.seq_len", "128", "--training.local_batch_size", "1"),
    "1B": ("--model.flavor", "1B", "--training.seq_len", "128", "--training.local_batch_size", "2"),
}  # fmt: skip
COMMON = (
    "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1",
    "--optimizer.implementation", "foreach", "--metrics.disable_color_printing",
    "--experimental.custom_import", "muon_bench_flavors",
)  # fmt: skip
LOG = re.compile(
    r"muon: to step (\d+): optimizer steps ([\d.]+) s, Newton-Schulz (\d+)% \((\d+) matrices on this rank\), "
    r"gathering matrices whole (\d+)%, scattering them back (\d+)%"
)
PEAK = re.compile(r"peak allocated ([\d.]+) GiB at")


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
        row["matrices"] = int(timed[-1].group(4))
        row["gather_pct"] = sum(int(m.group(5)) for m in timed) / len(timed)
        row["scatter_pct"] = sum(int(m.group(6)) for m in timed) / len(timed)
    return row


def traced_peak(shape: str, optimizer: str, ranks: int) -> float:
    """Peak allocated GiB of rank 0 in `titan-train dry-run` (one step traced on fake tensors, FSDP over
    `ranks`): the memory a run would take, where a CPU cannot train the shape."""
    flags = ["dry-run", "--ngpu", str(ranks), *COMMON, *SHAPES[shape], "--optimizer.name", optimizer]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *flags], capture_output=True, text=True, env=env, cwd=REPO
    )
    found = PEAK.search(done.stdout + done.stderr)
    if found is None:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return float(found.group(1))


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
        default="debug:1,debug:2",
        help="shape:ranks, comma-separated (2 ranks: FSDP 2)",
    )
    parser.add_argument(
        "--traced", default="1B:1,1B:2", help="shape:ranks whose memory the dry run traces (no training)"
    )
    a = parser.parse_args()
    rate = newton_schulz_rate()
    one_b = 16 * sum(newton_schulz_flops(r, c) for r, c in ONE_B_BLOCK)
    print(
        f"Newton-Schulz (bfloat16, one thread) here: {rate / 1e9:.2f} GFLOP/s; Llama 3.2 1B's 112 block matrices, "
        f"{one_b / 1e12:.1f} TFLOP a step, would take {one_b / rate / 3600:.1f} h in one process and "
        f"{one_b / rate / 2 / 3600:.1f} h a rank under FSDP 2 (shared out), gathers aside\n"
    )
    print(
        "| shape | layout | optimizer | step (s) | x AdamW | peak RSS rank 0 (GiB) | x AdamW | Muon step (s) "
        "| Newton-Schulz (matrices here) | gathers | scatters |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, nproc in (item.split(":") for item in a.rows.split(",") if item):
        adamw = None
        for optimizer in ("AdamW", "Muon"):
            r = run(shape, optimizer, int(nproc), a.steps)
            adamw = adamw or r
            layout = "1 process" if nproc == "1" else f"FSDP {nproc}"
            muon = (
                f"{r['optimizer_s']:.3f} | {r['ns_pct']:.0f}% ({r['matrices']}) | {r['gather_pct']:.0f}% "
                f"| {r['scatter_pct']:.0f}%"
                if "optimizer_s" in r
                else "- | - | - | -"
            )
            print(
                f"| {shape} | {layout} | {optimizer} | {r['step_s']:.2f} | {r['step_s'] / adamw['step_s']:.2f} "
                f"| {r['peak_gib']:.2f} | {r['peak_gib'] / adamw['peak_gib']:.2f} | {muon} |"
            )
            sys.stdout.flush()
    print("\n| shape | layout | AdamW traced peak (GiB) | Muon traced peak (GiB) | Muon / AdamW |")
    print("|---|---|---|---|---|")
    for shape, ranks in (item.split(":") for item in a.traced.split(",") if item):
        adamw, muon = (traced_peak(shape, o, int(ranks)) for o in ("AdamW", "Muon"))
        layout = "1 process" if ranks == "1" else f"FSDP {ranks}"
        print(f"| {shape} | {layout} | {adamw:.2f} | {muon:.2f} | {muon / adamw:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

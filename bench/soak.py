"""Soak: thousands of tiny training steps with every periodic feature on, watching for slow leaks.

Runs the real `titan-train` on a tiny Llama 3 shape (registered through `experimental.custom_import`,
as a user would add a flavor) with async checkpoints and retention, validation, and metrics with
TensorBoard. At each metrics log line it samples the training process's resident memory (VmRSS),
threads (both from /proc/PID/status) and open file descriptors (entries of /proc/PID/fd). It prints
the samples at the start and every 1,000 steps, and the growth per 1,000 steps after warm-up (the
slope of a least-squares line through every sample after it). Exits 1 with "LEAK: ..." when resident
memory grows by more than `--max-growth-mib` per 1,000 steps (the leak this soak found first grew by 2.2
MiB, bench/RESULTS.md), or open fds or threads by more than `--max-growth-count`. Counts are judged in
units, not percent: with 14 fds a single descriptor that an async save holds open at one late sample
fitted as +1.3% (a CI failure), while a real leak of one per checkpoint or validation adds at least 4 per
1,000 steps at the default intervals.

    uv run python bench/soak.py                      # 6,000 steps
    uv run python bench/soak.py --steps 2000 --warmup-steps 500
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "apps" / "configs" / "debug_model.toml"

FLAVOR_MODULE = '''"""The soak's tiny flavor: the Llama 3 debug model at dim 64 and 2 layers."""
from titan_train.registry import get_model_family, register_flavor

register_flavor("llama3", "soak", get_model_family("llama3").args_for("debugmodel", dim=64, n_layers=2, n_heads=4))
'''

STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:")


@dataclass(frozen=True)
class Sample:
    step: int
    seconds: float
    rss_mib: float
    fds: int
    threads: int


def sample(pid: int, step: int, seconds: float) -> Sample:
    """The process's resident memory, thread count and open file descriptors now."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return Sample(step, seconds, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads)


def growth_per_1000(samples: list[Sample], name: str) -> tuple[float, float]:
    """(slope per 1,000 steps of a least-squares line through `name`, that slope in % of its first value)."""
    xs = [s.step for s in samples]
    ys = [float(getattr(s, name)) for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    per_1000 = 1000 * slope
    return per_1000, 100 * per_1000 / ys[0]


def train_command(args: argparse.Namespace, dump: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "titan_train.cli",
        "--job.config_file",
        str(DEBUG_CONFIG),
        "--job.dump_folder",
        str(dump),
        "--experimental.custom_import",
        "soak_flavor",
        "--model.flavor",
        "soak",
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.batch),
        "--training.steps",
        str(args.steps),
        "--lr_scheduler.warmup_steps",
        "100",
        "--metrics.log_freq",
        str(args.sample_every),
        "--metrics.enable_tensorboard",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.interval",
        str(args.checkpoint_interval),
        "--checkpoint.keep_latest_k",
        "2",
        "--validation.enable",
        "--validation.dataset",
        "c4_test",
        "--validation.seq_len",
        str(args.seq_len),
        "--validation.local_batch_size",
        str(args.batch),
        "--validation.freq",
        str(args.validation_freq),
        "--validation.steps",
        "2",
    ]


def run_soak(args: argparse.Namespace, workdir: Path) -> list[Sample]:
    """Train in a child process, sampling it at every metrics log line; the samples, in step order."""
    (workdir / "soak_flavor.py").write_text(FLAVOR_MODULE)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{workdir}:{os.environ.get('PYTHONPATH', '')}",
    }
    command = train_command(args, workdir / "dump")
    print("$ " + " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    samples, tail = [], []
    for line in child.stdout:
        tail = [*tail[-40:], line]
        found = STEP_LINE.search(line)
        if found and "validation" not in line:
            samples.append(sample(child.pid, int(found.group(1)), time.perf_counter() - start))
    if child.wait() != 0:
        sys.exit(f"soak: titan-train exited {child.returncode}:\n{''.join(tail)}")
    return samples


def table(samples: list[Sample]) -> list[str]:
    """Markdown rows: the first sample, then the first at or after each multiple of 1,000 steps."""
    rows = ["| step | elapsed s | RSS MiB | open fds | threads |", "|---:|---:|---:|---:|---:|"]
    shown, next_mark = [samples[0]], 1000
    for s in samples[1:]:
        if s.step >= next_mark:
            shown.append(s)
            next_mark = (s.step // 1000 + 1) * 1000
    rows += [f"| {s.step:,} | {s.seconds:.0f} | {s.rss_mib:.1f} | {s.fds} | {s.threads} |" for s in shown]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--warmup-steps", type=int, default=1000, help="steps left out of the growth fit")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--sample-every", type=int, default=50, help="metrics.log_freq: a sample per log line"
    )
    parser.add_argument("--checkpoint-interval", type=int, default=200)
    parser.add_argument("--validation-freq", type=int, default=250)
    parser.add_argument(
        "--max-growth-count",
        type=float,
        default=2.0,
        help="open fds or threads, per 1,000 steps after warm-up",
    )
    parser.add_argument(
        "--max-growth-mib", type=float, default=1.0, help="RSS, per 1,000 steps after warm-up"
    )
    parser.add_argument("--csv", type=Path, help="also write every sample to this file")
    args = parser.parse_args()
    if args.steps < args.warmup_steps + 1000:
        parser.error("--steps must leave at least 1,000 steps after --warmup-steps to measure growth")

    with tempfile.TemporaryDirectory(prefix="titan-soak-") as tmp:
        samples = run_soak(args, Path(tmp))
    print("\n".join(table(samples)))
    if args.csv:
        lines = [f"{s.step},{s.seconds:.1f},{s.rss_mib:.1f},{s.fds},{s.threads}" for s in samples]
        args.csv.write_text("step,seconds,rss_mib,fds,threads\n" + "\n".join(lines) + "\n")
    after = [s for s in samples if s.step >= args.warmup_steps]
    leaks = []
    for name, unit in (("rss_mib", "MiB"), ("fds", "fds"), ("threads", "threads")):
        per_1000, pct = growth_per_1000(after, name)
        print(
            f"growth after step {after[0].step:,}: {name} {per_1000:+.3f} {unit} per 1,000 steps ({pct:+.3f}%)"
        )
        limit = args.max_growth_mib if name == "rss_mib" else args.max_growth_count
        if per_1000 > limit:
            leaks.append(f"{name} grows {per_1000:.2f} {unit} per 1,000 steps (more than {limit} {unit})")
    print(f"{len(samples)} samples, {samples[-1].step:,} steps in {samples[-1].seconds:.0f} s")
    if leaks:
        print("LEAK: " + "; ".join(leaks))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

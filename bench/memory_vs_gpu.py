"""Titan's traced memory estimate against the CUDA allocator's peaks of real runs on one GPU.

For every config, the estimate comes from `titan-train dry-run --ngpu 1` (one training step traced on
fake tensors, the allocator replayed on it) and the measurement from `titan-train` itself, run for
`--steps` steps under torchrun on the GPU with the same flags (bench/peak_memory_run.py writes
`torch.cuda.max_memory_allocated` and `max_memory_reserved` at exit). The table gives both and their
ratio. The issue's bounds: allocated within 5%, reserved within 10%.

On the GPU machine (after apps/gpu/fetch_wheels.sh here):
    apps/gpu/run.sh python3 bench/memory_vs_gpu.py --out $OUT/memory_vs_gpu.jsonl
Here, without a GPU, `--estimate-only` prints the estimates alone (to choose batches that fit).
A config is [FAMILY/]FLAVOR:AC=BATCH[+OPTION...] (FAMILY llama3 unless named, e.g.
`deepseek_v3/16B_4layers:none=1`); AC is none, op (selective per op), full or a number
(selective every N blocks); options: `fixed` (the allocator without expandable segments), `nochunk`
(the loss over the whole logits at once), `compiled`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from peak_memory_run import launch  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
GIB = 2**30
OPTIONS = {"fixed", "nochunk", "compiled"}

DEFAULT_CONFIGS = (
    "1B:none=1",
    "1B:op=2",
    "1B:full=4",
    "1B:none=1+nochunk",
    "1B:op=2+fixed",
    "3B:none=1",
    "3B:op=1",
    "3B:full=2",
    "8B_4layers:none=1",
    "8B_4layers:op=2",
    "8B_4layers:full=4",
    "1B:op=2+compiled",
)


@dataclass
class Config:
    flavor: str
    ac: str
    batch: int
    options: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Config:
        head, _, rest = text.partition("=")
        batch, *options = rest.split("+")
        flavor, _, ac = head.partition(":")
        if not (ac in ("none", "op", "full") or ac.isdigit()) or not set(options) <= OPTIONS:
            raise SystemExit(
                f"bad config {text!r}: FLAVOR:{{none,op,full,N}}=BATCH[+{'|'.join(sorted(OPTIONS))}]"
            )
        return cls(flavor, ac, int(batch), tuple(options))

    def __str__(self) -> str:
        return f"{self.flavor}:{self.ac}={self.batch}" + "".join(f"+{o}" for o in self.options)

    def flags(self, seq_len: int, steps: int) -> list[str]:
        """The same titan-train flags for the dry run and for the real run."""
        mode, option = ("selective", self.ac) if self.ac not in ("none", "full") else (self.ac, "op")
        flags = [
            "--job.config_file",
            str(REPO / "apps/configs/debug_model.toml"),
            "--experimental.custom_import",
            "cut_flavors",
            "--model.flavor",
            self.flavor,
            "--training.local_batch_size",
            str(self.batch),
            "--training.seq_len",
            str(seq_len),
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.disable_color_printing",
            "--training.mixed_precision_param",
            "bfloat16",
            "--activation_checkpoint.mode",
            mode,
            "--activation_checkpoint.selective_ac_option",
            option,
            "--lr_scheduler.warmup_steps",
            "2",
        ]
        if "/" in self.flavor:
            family, flavor = self.flavor.split("/")
            flags += ["--model.name", family, "--model.flavor", flavor]  # the later flag wins
        if "nochunk" in self.options:
            flags.append("--training.no_chunked_loss")
        if "compiled" in self.options:
            flags.append("--compile.enable")
        return flags

    def env(self) -> dict[str, str]:
        return run_env(expandable="fixed" not in self.options)


@dataclass
class Row:
    config: str
    estimated_allocated: int | None = None
    estimated_reserved: int | None = None
    where: str = ""
    estimate_seconds: float = 0.0
    measured_allocated: int | None = None
    measured_reserved: int | None = None
    measured_active: int | None = None
    measured_tps: float | None = None  # the real run's tokens/s, median of its steps after the first
    run_seconds: float = 0.0
    error: str | None = None
    trace: dict | None = None  # --real-trace: the step traced on real CUDA tensors, and on fake ones


# One traced rank's line of `titan-train dry-run` (also read by bench/memory_estimates.py).
ESTIMATE = re.compile(
    r"peak allocated ([\d.]+) GiB at (.*?); expected peak reserved ([\d.]+) GiB \(expandable segments\), "
    r"([\d.]+) GiB \(fixed segments\)"
)


def run_env(expandable: bool = True) -> dict[str, str]:
    """The environment of a dry run and of a real run: bench/ on the path (`cut_flavors`), datasets offline,
    the allocator's segments expandable or fixed."""
    path = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTORCH_ALLOC_CONF", None)
    return {**env, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}"}


def dry_run_estimate(flags: list[str], env: dict[str, str]) -> re.Match | str:
    """`titan-train dry-run --ngpu 1` of `flags`: the match of its estimate line (`ESTIMATE`), or the
    refusal it printed instead."""
    proc = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", "dry-run", "--ngpu", "1", *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    text = proc.stdout + proc.stderr
    return ESTIMATE.search(text) or f"dry run: {_last_line(text)}"


def estimate(c: Config, args, row: Row) -> None:
    """The dry run's traced estimate for one GPU (its worst rank, the only one here)."""
    started = time.perf_counter()
    match = dry_run_estimate(c.flags(args.seq_len, args.steps), c.env())
    row.estimate_seconds = time.perf_counter() - started
    if isinstance(match, str):
        row.error = match
        return
    allocated, where, expandable, fixed = match.groups()
    # The dry run prints GiB to two decimals: 5 MiB at most, far inside the bounds compared.
    row.estimated_allocated = round(float(allocated) * GIB)
    row.estimated_reserved = round(float(fixed if "fixed" in c.options else expandable) * GIB)
    row.where = where


def measure(c: Config, args, row: Row, keep: Path | None) -> None:
    """A real `titan-train` run of the same flags on the GPU; the allocator's peaks over the run."""
    started = time.perf_counter()
    name = f"{str(c).replace(':', '_').replace('=', '_b')}.log"
    run = launch(c.flags(args.seq_len, args.steps), c.env(), keep / name if keep else None)
    if run.returncode != 0:
        row.error = "OOM" if "out of memory" in run.text.lower() else _last_line(run.text)
    if run.peaks:
        row.measured_allocated, row.measured_reserved = run.peaks["allocated"], run.peaks["reserved"]
        row.measured_active = run.peaks["active"]
    tps = [r["tps"] for r in run.records if r["step"] > 1]
    row.measured_tps = statistics.median(tps) if tps else None
    row.run_seconds = time.perf_counter() - started


def trace_child(text: str, seq_len: int, steps: int) -> None:
    """In a child process: one step traced on real CUDA tensors (the tracker and the allocator replay
    against the allocator's own peaks in this process), then the same step on fake tensors."""
    import torch

    sys.path.insert(0, str(BENCH))
    from titan_parallel.allocator_model import replay
    from titan_train.config import load_job_config
    from titan_train.plan import resolve
    from titan_train.reporting.traced_memory import trace_rank

    c = Config.parse(text)
    config = load_job_config(c.flags(seq_len, steps))
    torch.cuda.reset_peak_memory_stats()
    real = trace_rank(resolve(config, 1), 0, fake=False)
    peaks = replay(real.sizes, real.streams, expandable_segments="fixed" not in c.options)
    fake = trace_rank(resolve(config, 1), 0, fake=True)
    print(
        "TRACE "
        + json.dumps(
            {
                "cuda_allocated": torch.cuda.max_memory_allocated(),
                "cuda_reserved": torch.cuda.max_memory_reserved(),
                "real_peak": real.peak,
                "real_replay_allocated": peaks.allocated,
                "real_replay_reserved": peaks.reserved,
                "real_where": " ".join(map(str, real.label)),
                "real_breakdown": real.breakdown,
                "fake_peak": fake.peak,
                "fake_where": " ".join(map(str, fake.label)),
                "fake_breakdown": fake.breakdown,
            }
        )
    )


def real_trace(c: Config, args, row: Row) -> None:
    """The tracker on real tensors beside the allocator: tells the tracker's error from the emulation's."""
    proc = subprocess.run(
        [sys.executable, __file__, "--trace-child", str(c), "--seq-len", str(args.seq_len)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=c.env(),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRACE ")]
    row.trace = json.loads(lines[-1][6:]) if lines else {"error": _last_line(proc.stdout + proc.stderr)}
    print(f"  {c}: " + json.dumps(row.trace), flush=True)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"(Error|error|refused)", ln)]
    return (lines[-1] if lines else (text.strip().splitlines() or ["no output"])[-1])[:240]


def _ratio(estimated: int | None, measured: int | None) -> str:
    return f"{estimated / measured:.3f}" if estimated and measured else ""


def _gib(value: int | None) -> str:
    return f"{value / GIB:.2f}" if value else ""


def print_table(rows: list[Row], header_line: str) -> None:
    print(f"\n{header_line}\n")
    print(
        "| config | estimated allocated GiB | measured allocated GiB | ratio | estimated reserved GiB "
        "| measured reserved GiB | ratio | estimated peak at | tokens/s | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.config} | {_gib(r.estimated_allocated)} | {_gib(r.measured_allocated)} "
            f"| {_ratio(r.estimated_allocated, r.measured_allocated)} | {_gib(r.estimated_reserved)} "
            f"| {_gib(r.measured_reserved)} | {_ratio(r.estimated_reserved, r.measured_reserved)} "
            f"| {r.where} | {f'{r.measured_tps:,.0f}' if r.measured_tps else ''} | {r.error or ''} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="FLAVOR:AC=BATCH[+OPTION],...")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--estimate-only", action="store_true", help="no GPU: print the estimates alone")
    parser.add_argument("--keep", type=Path, help="folder to keep each real run's log in")
    parser.add_argument("--out", type=Path, help="JSON lines: one record per config")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier --out file and stop")
    parser.add_argument("--real-trace", action="store_true", help="also trace each step on real CUDA tensors")
    parser.add_argument("--trace-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trace_child:
        trace_child(args.trace_child, args.seq_len, args.steps)
        return
    if args.table_from:
        records = [json.loads(line) for line in args.table_from.read_text().splitlines()]
        header = records[0].pop("device")
        print_table([Row(**{k: v for k, v in r.items() if k != "device"}) for r in records], header)
        return
    import torch

    if not args.estimate_only and not torch.cuda.is_available():
        raise SystemExit("the real runs need a CUDA GPU: run on the GPU machine, or pass --estimate-only")
    device = (
        "estimates only"
        if args.estimate_only
        else f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    header = (
        f"seq {args.seq_len}, {args.steps} steps, one GPU, bf16 autocast, eager unless +compiled; {device}"
    )
    rows = []
    for c in map(Config.parse, args.configs.split(",")):
        row = Row(str(c))
        estimate(c, args, row)
        if not args.estimate_only and row.error is None:
            measure(c, args, row, args.keep)
            if args.real_trace:
                real_trace(c, args, row)
        rows.append(row)
        print(
            f"{c}: estimated {_gib(row.estimated_allocated)} / {_gib(row.estimated_reserved)} GiB "
            f"({row.estimate_seconds:.0f} s), measured {_gib(row.measured_allocated)} / "
            f"{_gib(row.measured_reserved)} GiB ({row.run_seconds:.0f} s) {row.error or ''}",
            flush=True,
        )
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps({**asdict(row), "device": header}) + "\n")
    print_table(rows, header)


if __name__ == "__main__":
    main()

"""Titan against torchtitan on one GPU, alternately, in one command: Llama 3.2 1B and 3B at seq 8192,
and mixture-of-experts models cut to 4 blocks (bench/cut_flavors.py).

For every model, mode (bf16 eager; compiled; compiled with float8 tensorwise) and activation
checkpointing (per-op selective; none), both trainers train the same untied model
(bench/untied_flavors.py) on the same data at the same local batch for `--steps` steps, logging every
`--log-freq` steps; the first window (compilation, allocator warm-up) is dropped and the median of the
rest reported. A bf16 8192^3 matmul is timed in this process first: MFU is given against the
H100 datasheet peak (989.4 TFLOP/s) and against that measured ceiling. One FLOP formula
(titan_models.flops_per_token) counts for both trainers.

A FLAVOR is a dense Llama 3.2 shape (`1B`, `3B`: trained untied) or FAMILY/FLAVOR for a cut of
bench/cut_flavors.py that both trainers know (`deepseek_v3/16B_4layers`, `qwen3/30B-A3B_4layers`).

On the GPU machine (after apps/gpu/fetch_wheels.sh here):
    apps/gpu/run.sh python bench/gpu_throughput.py --out $OUT/gpu_bench.jsonl
    apps/gpu/run.sh python bench/gpu_throughput.py --configs 1B:compiled:none=2 --trainers titan
A config is FLAVOR:MODE:AC=BATCH; an OOM is reported as such, never retried at another batch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from train_throughput import _torchrun  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
C4_TEST = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "c4_test"
TORCHTITAN_TOKENIZER = REPO / ".whl" / "assets" / "torchtitan-test-tokenizer"
DATASHEET_PEAK = 989.4e12  # H100 SXM dense bf16

# The largest local batch that fit on an 80 GB H100 for both trainers (bench/RESULTS.md).
DEFAULT_CONFIGS = (
    "1B:eager:selective=2",
    "1B:compiled:selective=2",
    "1B:float8:selective=2",
    "1B:eager:none=1",
    "1B:compiled:none=1",
    "1B:float8:none=1",
    "3B:eager:selective=1",
    "3B:compiled:selective=1",
    "3B:float8:selective=1",
)


@dataclass
class Config:
    flavor: str
    mode: str  # eager, compiled, float8 (compiled + float8 tensorwise)
    ac: str  # selective (per op), none, full
    batch: int

    @classmethod
    def parse(cls, text: str) -> Config:
        head, batch = text.split("=")
        flavor, mode, ac = head.split(":")
        if mode not in ("eager", "compiled", "float8") or ac not in ("selective", "none", "full"):
            raise SystemExit(
                f"bad config {text!r}: FLAVOR:{{eager,compiled,float8}}:{{selective,none,full}}=BATCH"
            )
        return cls(flavor, mode, ac, int(batch))

    def __str__(self) -> str:
        return f"{self.flavor} {self.mode} ac={self.ac} b={self.batch}"


@dataclass
class Run:
    trainer: str
    config: Config
    tps: list[float] = field(default_factory=list)
    active_gib: list[float] = field(default_factory=list)
    reserved_gib: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def median(self, name: str) -> float | None:
        values = getattr(self, name)
        return statistics.median(values) if values else None


def measured_matmul_peak() -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data: the median of 20 timed products after warm-up."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times)


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    }


def _last_error(text: str) -> str:
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        return "OOM"
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"(Error|Exception):", ln)]
    return (lines[-1] if lines else (text.strip().splitlines() or ["no output"])[-1])[:240]


def _model_flags(c: Config) -> list[str]:
    """The model's name, flavor and the bench module that registers it, the same for both trainers."""
    if "/" in c.flavor:
        family, flavor = c.flavor.split("/")
        return [
            "--experimental.custom_import",
            "cut_flavors",
            "--model.name",
            family,
            "--model.flavor",
            flavor,
        ]
    return [
        "--experimental.custom_import",
        "untied_flavors",
        "--model.name",
        "llama3",
        "--model.flavor",
        f"{c.flavor}_untied",
    ]


def _common(c: Config, args) -> list[str]:
    """Flags both trainers take the same way (torchtitan's schema is Titan's)."""
    flags = [
        *_model_flags(c),
        "--training.local_batch_size",
        str(c.batch),
        "--training.seq_len",
        str(args.seq_len),
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        str(args.log_freq),
        "--training.mixed_precision_param",
        "bfloat16",
        "--lr_scheduler.warmup_steps",
        "2",
        "--activation_checkpoint.mode",
        c.ac,
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    if c.mode in ("compiled", "float8"):
        flags += ["--compile.enable"]
    return flags


def run_titan(c: Config, args, run: Run, dump: Path) -> None:
    flags = [
        "--job.config_file",
        str(REPO / "apps/configs/debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.disable_color_printing",
        *_common(c, args),
    ]
    if c.mode == "float8":
        flags += ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output"]
    if args.profile and c.mode != "eager":
        flags += [
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            str(args.steps),
            "--profiling.save_traces_folder",
            "traces",
        ]
    proc = subprocess.run(
        [*_torchrun(1), "-m", "titan_train.cli", *flags], capture_output=True, text=True, cwd=REPO, env=_env()
    )
    (dump / "log.txt").write_text(proc.stdout + proc.stderr)
    read_titan_metrics(dump / "metrics.jsonl", args.log_freq, run)
    if proc.returncode != 0:
        failure = _last_error(proc.stdout + proc.stderr)
        # A run that logged its measured steps and failed after them keeps its numbers, marked.
        run.error = failure if not run.tps else f"exit {proc.returncode} after the last step: {failure}"


def read_titan_metrics(metrics: Path, log_freq: int, run: Run) -> None:
    """The measured windows of a Titan run's metrics.jsonl (all but the first) into `run`."""
    if not metrics.exists():
        return
    for record in map(json.loads, metrics.read_text().splitlines()):
        if record["step"] > log_freq:
            run.tps.append(record["tps"])
            run.reserved_gib.append(record["memory_gib"])
            run.active_gib.append(record["memory_active_gib"])
            run.loss.append(record["loss"])


def run_torchtitan(c: Config, args, run: Run, dump: Path) -> None:
    # Titan's bundled c4_test under a file name that `datasets` reads as the "train" split.
    data = dump / "c4_test"
    data.mkdir()
    (data / "data.jsonl").write_bytes((C4_TEST / "c4_test.jsonl").read_bytes())
    flags = [
        "--job.dump_folder",
        str(dump),
        "--model.hf_assets_path",
        str(args.torchtitan_tokenizer),
        "--training.dataset",
        "c4_test",
        "--training.dataset_path",
        str(data),
        "--metrics.disable_color_printing",
        *_common(c, args),
    ]
    if c.mode == "float8":
        flags += [
            "--model.converters",
            "quantize.linear.float8",
            "--quantize.linear.float8.filter_fqns",
            "output",
        ]
    proc = subprocess.run(
        [*_torchrun(1), "-m", "torchtitan.train", *flags],
        capture_output=True,
        text=True,
        cwd=dump,
        env=_env(),
    )
    text = proc.stdout + proc.stderr
    (dump / "log.txt").write_text(text)
    if proc.returncode != 0:
        run.error = _last_error(text)
        return
    active = [float(m) for m in re.findall(r"bench-memory: active ([\d.]+) GiB", text)]
    steps = [ln for ln in text.splitlines() if re.search(r"step:\s*\d+.*tps:", ln)]
    for line, active_gib in zip(steps, active, strict=False):
        step = int(re.search(r"step:\s*(\d+)", line).group(1))
        if step > args.log_freq:
            run.tps.append(float(re.search(r"tps:\s*([\d,]+)", line).group(1).replace(",", "")))
            run.reserved_gib.append(float(re.search(r"memory:\s*([\d.]+)GiB", line).group(1)))
            run.active_gib.append(active_gib)
            run.loss.append(float(re.search(r"loss:\s*([\d.]+)", line).group(1)))


def flops_per_token(flavor: str, seq_len: int) -> float:
    """Training FLOPs per token of the flavor, by Titan's formula (the same for both trainers; an MoE
    family counts its active experts)."""
    if "/" in flavor:
        from titan_train.registry import get_model_family

        importlib.import_module("cut_flavors")  # after titan_train: it registers the cuts with what is loaded

        name, cut = flavor.split("/")
        family = get_model_family(name)
        margs = family.args_for(cut, max_seq_len=seq_len, eos_id=0)  # any id: FLOPs do not depend on it
        with torch.device("meta"):
            model = family.build(margs)
        total, embedding = family.count_parameters(model)
        return family.flops_per_token(margs, total, embedding, seq_len)
    from titan_models import LLAMA3_FLAVORS, Transformer, count_parameters, flops_per_token

    args = replace(LLAMA3_FLAVORS[flavor], tie_word_embeddings=False, max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    n = count_parameters(model)
    return flops_per_token(args, n, n - count_parameters(model, exclude_embedding=True), seq_len)


def print_table(runs: list[Run], matmul_peak: float, args, device: str) -> None:
    print(
        f"\nseq {args.seq_len}, {args.steps} steps (log every {args.log_freq}, first window dropped), "
        f"{device}; bf16 matmul measured {matmul_peak / 1e12:.0f} TFLOP/s, "
        f"datasheet {DATASHEET_PEAK / 1e12:.0f}\n"
    )
    header = (
        "| config | trainer | tokens/s/GPU | TFLOP/s | MFU % (datasheet) | MFU % (measured mm) "
        "| peak active GiB | peak reserved GiB | Titan/torchtitan |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    by_config: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_config.setdefault(str(run.config), {})[run.trainer] = run
    for name, pair in by_config.items():
        titan, theirs = pair.get("titan"), pair.get("torchtitan")
        ratio = "n/a"
        if titan and theirs and titan.median("tps") and theirs.median("tps"):
            ratio = f"{titan.median('tps') / theirs.median('tps'):.3f}"
        for trainer, run in pair.items():
            if not run.tps:
                print(f"| {name} | {trainer} | {run.error or 'no measured window'} | | | | | | |")
                continue
            tps = run.median("tps")
            flops = flops_per_token(run.config.flavor, args.seq_len) * tps
            print(
                f"| {name} | {trainer} | {tps:,.0f} | {flops / 1e12:.0f} | {100 * flops / DATASHEET_PEAK:.1f} "
                f"| {100 * flops / matmul_peak:.1f} | {run.median('active_gib'):.1f} | {run.median('reserved_gib'):.1f} "
                f"| {ratio if trainer == 'titan' else ''} |" + (f" ({run.error})" if run.error else "")
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="FLAVOR:MODE:AC=BATCH,...")
    parser.add_argument("--trainers", default="titan,torchtitan")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="alternating rounds of every run")
    parser.add_argument(
        "--profile", action="store_true", help="Titan writes a profiler trace of its last step"
    )
    parser.add_argument("--torchtitan-tokenizer", type=Path, default=TORCHTITAN_TOKENIZER)
    parser.add_argument("--keep", type=Path, help="folder to keep each run's log (and trace) in")
    parser.add_argument("--out", type=Path, help="JSON lines: one record per run")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier --out file and stop")
    args = parser.parse_args()
    if args.table_from:
        records = [json.loads(line) for line in args.table_from.read_text().splitlines()]
        fields = set(Run.__dataclass_fields__)
        runs = [
            Run(**{k: v for k, v in r.items() if k in fields} | {"config": Config.parse(r["config"])})
            for r in records
        ]
        print_table(runs, records[0]["matmul_peak"], args, records[0]["device"])
        return
    configs = [Config.parse(text) for text in args.configs.split(",")]
    trainers = args.trainers.split(",")
    matmul_peak = measured_matmul_peak()
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    runs: list[Run] = []
    for round_ in range(args.repeats):
        for c in configs:
            for trainer in trainers:
                run = Run(trainer, c)
                started = time.perf_counter()
                with tempfile.TemporaryDirectory() as tmp:
                    dump = Path(tmp)
                    (run_titan if trainer == "titan" else run_torchtitan)(c, args, run, dump)
                    if args.keep:
                        kept = (
                            args.keep
                            / f"{trainer}-{c.flavor.replace('/', '-')}-{c.mode}-{c.ac}-b{c.batch}-r{round_}"
                        )
                        kept.mkdir(parents=True, exist_ok=True)
                        for item in ("log.txt", "metrics.jsonl"):
                            if (dump / item).exists():
                                (kept / item).write_text((dump / item).read_text())
                        for trace in dump.glob("traces/**/*.json*"):
                            (kept / trace.name).write_bytes(trace.read_bytes())
                run.seconds = time.perf_counter() - started
                runs.append(run)
                tps = run.median("tps")
                print(
                    f"[{run.seconds:5.0f}s] {trainer:<10} {c}: "
                    f"{run.error or f'{tps:,.0f} tokens/s' if tps else run.error or 'no window'}",
                    flush=True,
                )
                if args.out:
                    with args.out.open("a") as out:
                        record = {**asdict(run), "config": f"{c.flavor}:{c.mode}:{c.ac}={c.batch}"}
                        out.write(json.dumps({**record, "matmul_peak": matmul_peak, "device": device}) + "\n")
    print_table(runs, matmul_peak, args, device)


if __name__ == "__main__":
    main()

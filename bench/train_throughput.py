"""Titan against torchtitan (and a plain PyTorch loop) on the same work, alternately, in one run.

Each runner trains the Llama 3 `--flavor` at `--batch` x `--seq-len` for `--steps` steps; the first
`--warmup` steps are dropped and the median of the rest is reported. Runners alternate (`--repeats`
rounds), so slow drift of the machine hits all of them alike. torchtitan (PyPI 0.3.0) is installed
into its own environment under bench/.torchtitan-env, never into the project's; where it cannot run
(it needs CUDA), the table says why and the plain single-process loop is the reference instead.

    uv run python bench/train_throughput.py                        # CPU: debug model, batch 8 x 2048
    uv run python bench/train_throughput.py --flavor 1B --seq-len 8192 --batch 1 --compile --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan_train.torchrun import torchrun_command

REPO = Path(__file__).resolve().parents[1]
TORCHTITAN_ENV = REPO / "bench" / ".torchtitan-env"
TORCHTITAN_ASSETS = REPO.parent / "shared" / "anchor-assets" / "torchtitan-test-tokenizer"
C4_TEST = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "c4_test"


@dataclass
class Result:
    runner: str
    nproc: int
    tps: list[float] = field(default_factory=list)
    tflops: list[float] = field(default_factory=list)
    mfu: list[float] = field(default_factory=list)
    memory_gib: list[float] = field(default_factory=list)
    error: str | None = None

    def median(self, name: str) -> float | None:
        values = [v for v in getattr(self, name) if v is not None]
        return statistics.median(values) if values else None


def _torchrun(nproc: int, python: str = sys.executable) -> list[str]:
    """The torchrun launcher (`python -m torch.distributed.run ...`) for `nproc` ranks on this machine."""
    return torchrun_command(nproc=nproc, python=python)


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.search(r"(Error|Exception):", ln)]
    return lines[-1][:200] if lines else text.strip().splitlines()[-1][:200] if text.strip() else "no output"


def run_titan(args, nproc: int, compiled: bool, result: Result) -> None:
    with tempfile.TemporaryDirectory() as dump:
        overrides = [
            "--job.config_file",
            str(REPO / "apps/configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--model.flavor",
            args.flavor,
            "--training.local_batch_size",
            str(args.batch),
            "--training.seq_len",
            str(args.seq_len),
            "--training.steps",
            str(args.steps),
            "--training.mixed_precision_param",
            args.dtype,
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.disable_color_printing",
            *(["--compile.enable"] if compiled else []),
        ]
        launcher = _torchrun(nproc) if nproc > 1 else [sys.executable]
        proc = subprocess.run(
            [*launcher, "-m", "titan_train.cli", *overrides], capture_output=True, text=True, cwd=REPO
        )
        metrics = Path(dump) / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.exists():
            result.error = _last_error(proc.stdout + proc.stderr)
            return
        for record in map(json.loads, metrics.read_text().splitlines()):
            if record["step"] > args.warmup:
                result.tps.append(record["tps"])
                result.tflops.append(record["tflops"])
                result.mfu.append(record["mfu"])
                result.memory_gib.append(record["memory_gib"])


def run_plain(args, result: Result) -> None:
    cmd = [
        sys.executable,
        str(REPO / "bench/plain_pytorch_loop.py"),
        "--flavor",
        args.flavor,
        "--batch",
        str(args.batch),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        result.error = _last_error(proc.stderr)
        return
    for record in map(json.loads, proc.stdout.splitlines()):
        if record["step"] > args.warmup:
            result.tps.append(record["tps"])
            result.memory_gib.append(record["memory_gib"])


def ensure_torchtitan_env() -> str:
    """Python of a separate environment with torchtitan 0.3.0 and this torch version."""
    python = TORCHTITAN_ENV / "bin" / "python"
    if not python.exists():
        uv = shutil.which("uv")
        if uv is None:
            raise RuntimeError("uv is needed to build the torchtitan environment: pip install uv")
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(TORCHTITAN_ENV)], check=True)
        torch_version = torch.__version__.split("+")[0]
        subprocess.run(
            [
                uv,
                "pip",
                "install",
                "-q",
                "--python",
                str(python),
                "torchtitan==0.3.0",
                f"torch=={torch_version}",
            ],
            check=True,
        )
    return str(python)


def run_torchtitan(args, nproc: int, compiled: bool, result: Result) -> None:
    try:
        python = ensure_torchtitan_env()
    except (RuntimeError, subprocess.CalledProcessError) as err:
        result.error = f"could not install torchtitan: {err}"
        return
    with tempfile.TemporaryDirectory() as dump:
        overrides = [
            # bench/torchtitan_bench_configs.py: torchtitan's debugmodel config with the flavor swapped in
            "--module",
            "torchtitan_bench_configs",
            "--config",
            f"llama3_bench_{args.flavor}",
            "--dump_folder",
            dump,
            "--hf_assets_path",
            str(TORCHTITAN_ASSETS),
            "--dataloader.dataset_path",
            str(C4_TEST),
            "--training.local_batch_size",
            str(args.batch),
            "--training.seq_len",
            str(args.seq_len),
            "--training.steps",
            str(args.steps),
            "--metrics.log_freq",
            "1",
            "--training.mixed_precision_param",
            args.dtype,
            *(["--compile.enable"] if compiled else []),
        ]
        proc = subprocess.run(
            [*_torchrun(nproc, python), "-m", "torchtitan.train", *overrides],
            capture_output=True,
            text=True,
            cwd=dump,
            env={**os.environ, "PYTHONPATH": str(REPO / "bench")},
        )
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        result.error = _last_error(text)
        return
    for line in text.splitlines():
        step = re.search(r"step:\s*(\d+)", line)
        tps = re.search(r"tps:\s*([\d,]+)", line)
        if step and tps and int(step.group(1)) > args.warmup:
            result.tps.append(float(tps.group(1).replace(",", "")))
            for name, pattern in (
                ("tflops", r"tflops:\s*([\d.]+)"),
                ("mfu", r"mfu:\s*([\d.]+)%"),
                ("memory_gib", r"memory:\s*([\d.]+)GiB"),
            ):
                found = re.search(pattern, line)
                getattr(result, name).append(float(found.group(1)) if found else None)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(results: list[Result], reference: Result | None) -> None:
    ref_tps = reference.median("tps") if reference else None
    header = f"| {'runner':<22} | procs | tokens/s/device | tflops | mfu % | peak mem GiB | vs {reference.runner if reference else 'ref'} |"
    print(header)
    print("|" + "|".join("-" * (len(part)) for part in header.split("|")[1:-1]) + "|")
    for r in results:
        if r.error:
            print(f"| {r.runner:<22} | {r.nproc:>5} | could not run: {r.error}")
            continue
        tps = r.median("tps")
        ratio = f"{tps / ref_tps:.3f}x" if ref_tps and tps else "n/a"
        print(
            f"| {r.runner:<22} | {r.nproc:>5} | {_fmt(tps, ',.0f'):>15} | {_fmt(r.median('tflops'), '.3f'):>6} | "
            f"{_fmt(r.median('mfu'), '.2f'):>5} | {_fmt(r.median('memory_gib'), '.2f'):>12} | {ratio:>8} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds of every runner")
    parser.add_argument("--nproc", default="1,2", help="process counts for Titan and torchtitan")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="torch.compile the trainers' blocks; 'both' runs eager and compiled side by side",
    )
    parser.add_argument("--skip-torchtitan", action="store_true")
    args = parser.parse_args()
    nprocs = [int(n) for n in args.nproc.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    layouts = [(n, compiled) for n in nprocs for compiled in modes]

    def name(trainer: str, n: int, compiled: bool) -> str:
        return trainer + (f" FSDP-{n}" if n > 1 else "") + (" compiled" if compiled else "")

    plain = Result("plain PyTorch loop", 1)
    titan = {(n, c): Result(name("titan", n, c), n) for n, c in layouts}
    torchtitan = {(n, c): Result(name("torchtitan 0.3.0", n, c), n) for n, c in layouts}
    for round_ in range(args.repeats):
        print(f"round {round_ + 1}/{args.repeats}", file=sys.stderr, flush=True)
        run_plain(args, plain)
        for n, c in layouts:
            run_titan(args, n, c, titan[n, c])
            if not args.skip_torchtitan and torchtitan[n, c].error is None:
                run_torchtitan(args, n, c, torchtitan[n, c])

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(
        f"\n{args.flavor}, local batch {args.batch} x seq {args.seq_len}, {args.dtype}, compile={args.compile}, "
        f"{args.steps - args.warmup} measured steps x {args.repeats} rounds, {device}\n"
    )
    tt_ok = not args.skip_torchtitan and all(r.error is None for r in torchtitan.values())
    rows = [plain, *titan.values(), *([] if args.skip_torchtitan else torchtitan.values())]
    print_table(rows, torchtitan[layouts[0]] if tt_ok else plain)
    if tt_ok:  # each Titan row against torchtitan on the same layout
        for key in layouts:
            ours, theirs = titan[key].median("tps"), torchtitan[key].median("tps")
            if ours and theirs:
                print(f"{titan[key].runner} / {torchtitan[key].runner}: {ours / theirs:.3f}x")
    elif not args.skip_torchtitan:
        error = torchtitan[layouts[0]].error
        print(f"\ntorchtitan could not run here ({error}); ratios are against the plain loop.")
    for n, c in layouts:
        one = titan.get((1, c))
        if n > 1 and one and one.median("tps") and titan[n, c].median("tps"):
            total = n * titan[n, c].median("tps")
            print(
                f"{titan[n, c].runner}: {total:,.0f} tokens/s in all = {total / one.median('tps'):.2f}x one process on the same cores"
            )


if __name__ == "__main__":
    main()

"""The traced memory estimate for the layouts users ask about before booking GPUs: a table per rank.

Each row is `titan-train dry-run --ngpu N` on one of the bundled configs with the flags shown (one training
step traced on fake tensors, the CUDA caching allocator replayed on it): peak allocated and expected peak
reserved with and without expandable segments, for every rank kind the dry run traces, and the wall time of
the whole command on this machine.

    uv run python bench/memory_estimates.py            # all rows (about 3 minutes on 2 cores)
    uv run python bench/memory_estimates.py --only 8b  # rows whose name contains "8b"
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from memory_vs_gpu import ESTIMATE  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "apps" / "configs"
SEQ_8192_OP = (
    "--training.seq_len",
    "8192",
    "--activation_checkpoint.mode",
    "selective",
    "--activation_checkpoint.selective_ac_option",
    "op",
)
COMPILE_FLOAT8 = (
    "--compile.enable",
    "--model.converters",
    "float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
)

# name, config file, world size, flags
ROWS = (
    ("8b bf16 FSDP, batch 1", "llama3_8b.toml", 32, (*SEQ_8192_OP, "--training.local_batch_size", "1")),
    (
        "8b + compile + float8",
        "llama3_8b.toml",
        32,
        (*SEQ_8192_OP, "--training.local_batch_size", "1", *COMPILE_FLOAT8),
    ),
    ("8b batch 5", "llama3_8b.toml", 12, (*SEQ_8192_OP, "--training.local_batch_size", "5")),
    ("8b batch 5", "llama3_8b.toml", 36, (*SEQ_8192_OP, "--training.local_batch_size", "5")),
    ("8b batch 5", "llama3_8b.toml", 68, (*SEQ_8192_OP, "--training.local_batch_size", "5")),
    ("70b FSDP 32 x TP 8", "llama3_70b.toml", 256, ()),
    ("405b FSDP 8 x TP 8 x PP 8", "llama3_405b.toml", 512, ()),
    (
        "deepseek 671b FSDP x PP 8 x EP 32",
        "deepseek_v3_671b.toml",
        256,
        ("--parallelism.pipeline_parallel_degree", "8", "--parallelism.expert_parallel_degree", "32"),
    ),
    (
        "llama4 17bx128e FSDP x TP 8 x EP 8",
        "llama4_17bx16e.toml",
        256,
        ("--model.flavor", "17bx128e", "--parallelism.expert_parallel_degree", "8"),
    ),
)

RANK = re.compile(r"rank (\d+) \(pp stage (\d+)\): " + ESTIMATE.pattern)
LAYOUT = re.compile(r"mesh: \(([^)]*)\)")


def dry_run(config: str, world_size: int, flags: tuple[str, ...]) -> tuple[str, list[tuple[str, ...]], float]:
    """The mesh and the traced ranks printed by one dry run, and its wall seconds."""
    command = [
        sys.executable,
        "-m",
        "titan_train.cli",
        "dry-run",
        "--ngpu",
        str(world_size),
        "--job.config_file",
        str(CONFIGS / config),
        *flags,
    ]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out[-3000:]}")
    mesh = LAYOUT.search(out)
    return (mesh.group(1) if mesh else "?"), RANK.findall(out), seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="run the rows whose name contains this text")
    args = parser.parse_args()
    print(
        "| config | GPUs | mesh | rank (pp stage) | peak allocated | reserved, expandable | reserved, fixed "
        "| peak at | dry run |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config, world_size, flags in ROWS:
        if args.only and args.only not in name:
            continue
        mesh, ranks, seconds = dry_run(config, world_size, flags)
        for rank, stage, allocated, where, expandable, fixed in ranks:
            print(
                f"| {name} | {world_size} | {mesh} | {rank} ({stage}) | {allocated} GiB | {expandable} GiB "
                f"| {fixed} GiB | {where} | {seconds:.1f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Peak host memory (RSS) of each rank while a Hugging Face export is written, and while it is read back.

`uv run python bench/hf_export_memory.py --out DIR [--scale 1.0] [--models llama3,qwen3] [--layouts "FSDP 4"]`: for a ~1 GB (fp32) Llama and a ~1 GB
Qwen3-MoE (`--scale` shrinks both), on 4 ranks in each of FSDP 4, TP 2 x FSDP 2, PP 2 x FSDP 2 and
EP 2 x FSDP 4, one torchrun trains one step with `checkpoint.last_save_in_hf`, then a second run of the
same layout starts from that folder with `initial_load_in_hf`. A sampler thread in every rank reads
/proc/self/statm every 2 ms while the export (`Checkpointer._write_hf`) and the import
(`load_hf_weights`) run. Per rank and phase the table gives the rise (peak minus the RSS just before:
what the phase itself took) and the peak RSS (which also holds what training left, such as freed memory
the allocator keeps), each as (highest rank - median rank) / model bytes: the issue bounds the peak's at
0.5 (the whole-model gather on rank 0 measured 3.7).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("hf_export_memory_worker.py")
DEBUG_CONFIG = Path(__file__).parents[1] / "apps" / "configs" / "debug_model.toml"
P = "--parallelism."
LAYOUTS = {
    "FSDP 4": (f"{P}data_parallel_shard_degree", "4"),
    "TP 2 x FSDP 2": (f"{P}data_parallel_shard_degree", "2", f"{P}tensor_parallel_degree", "2"),
    "PP 2 x FSDP 2": (
        f"{P}data_parallel_shard_degree",
        "2",
        f"{P}pipeline_parallel_degree",
        "2",
        f"{P}pipeline_parallel_schedule",
        "1F1B",
    ),
    "EP 2 x FSDP 4": (f"{P}data_parallel_shard_degree", "4", f"{P}expert_parallel_degree", "2"),
}
MODELS = {"llama3": ("FSDP 4", "TP 2 x FSDP 2", "PP 2 x FSDP 2"), "qwen3": tuple(LAYOUTS)}
COMMON = (
    "--job.config_file",
    str(DEBUG_CONFIG),
    "--model.flavor",
    "bench_1gb",
    "--metrics.disable_color_printing",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--activation_checkpoint.mode",
    "none",
    "--checkpoint.enable",
    "--checkpoint.keep_latest_k",
    "0",
)


def torchrun(argv: list[str], record: Path, scale: float) -> list[dict]:
    env = {**os.environ, "HF_EXPORT_BENCH_SCALE": str(scale), "HF_EXPORT_BENCH_RECORD": str(record)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", str(WORKER), *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"torchrun failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return [json.loads(line) for line in record.read_text().splitlines()]


def row(model: str, layout: str, what: str, records: list[dict]) -> str:
    """One table row: each rank's rise and peak in the phase, and (max - median) / model of both."""
    ranks = sorted((r for r in records if r["what"] == what), key=lambda r: r["rank"])
    size = ranks[0]["model_bytes"]
    rise = [r["peak"] - r["before"] for r in ranks]
    peak = [r["peak"] for r in ranks]

    def mib(values: list[int]) -> str:
        return " / ".join(f"{v / 2**20:.0f}" for v in values)

    def spread(values: list[int]) -> str:
        return f"{(max(values) - statistics.median(values)) / size:.2f}"

    return f"| {model} | {layout} | {what} | {size / 2**20:.0f} | {mib(rise)} | {spread(rise)} | {mib(peak)} | {spread(peak)} |"


HEADER = (
    "| model | layout | phase | model MiB | rise per rank MiB (ranks 0-3) | (max - median rise) / model "
    "| peak RSS per rank MiB | (max - median peak) / model |\n|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scale", type=float, default=1.0, help="model size as a share of 1 GB (fp32)")
    parser.add_argument("--models", default="llama3,qwen3")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="a subset of: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        # Qwen3-MoE trains an expert bias its Hugging Face class cannot hold: the export must opt in.
        lossy = ["--checkpoint.hf_export_lossy"] if model == "qwen3" else []
        for layout in [x for x in MODELS[model] if x in args.layouts.split(",")]:
            dump = args.out / f"{model}-{layout.replace(' ', '')}"
            shutil.rmtree(dump, ignore_errors=True)
            dump.mkdir(parents=True)
            base = [*COMMON, "--model.name", model, *LAYOUTS[layout], "--job.dump_folder"]
            started = time.perf_counter()
            export = torchrun(
                [
                    *base,
                    str(dump / "export"),
                    "--training.steps",
                    "1",
                    "--checkpoint.last_save_in_hf",
                    *lossy,
                ],
                dump / "export.jsonl",
                args.scale,
            )
            folder = dump / "export" / "checkpoint" / "step-1"
            read = torchrun(
                [
                    *base,
                    str(dump / "import"),
                    "--training.steps",
                    "0",
                    "--checkpoint.initial_load_in_hf",
                    "--checkpoint.initial_load_path",
                    str(folder),
                ],
                dump / "import.jsonl",
                args.scale,
            )
            for what, records in (("export", export), ("import", read)):
                rows.append(row(model, layout, what, records))
                print(rows[-1], flush=True)
            print(f"{model} {layout}: {time.perf_counter() - started:.0f} s", flush=True)
            for sub in ("export", "import"):  # the GBs of DCP and safetensors files are not kept
                shutil.rmtree(dump / sub, ignore_errors=True)
    print()
    print(HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

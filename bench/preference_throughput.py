"""Preference tuning throughput: trained (completion) tokens per second and peak memory, packed against
padded pairs, and the reference kinds: a frozen copy, the LoRA base with adapters off, none (SimPO).

The debug model (apps/configs/debug_dpo.toml: llama3 debugmodel, the bundled preference pairs) trains
one case per child process (so each peak resident memory is its own), `--steps` timed steps after one
warm-up step. Trained tokens are the completion tokens of the batches the timed steps took (labels !=
-100). Padded windows hold one pair in two rows; packed ones hold as many whole pairs as fit one row, so
the same `--batch` of windows is a different number of pairs: compare tokens/s, not seconds. A
precomputed reference is not available yet (preference.reference = "precompute" is refused).

    uv run python bench/preference_throughput.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LORA = ["--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "8"]
CASES = {
    "packed, frozen copy": ["--sft.packing", "true"],
    "padded, frozen copy": ["--sft.packing", "false"],
    "packed, LoRA, frozen copy": ["--sft.packing", "true", *LORA, "--preference.reference", "copy"],
    "packed, LoRA, adapters off": ["--sft.packing", "true", *LORA, "--preference.reference", "auto"],
    "packed, no reference (simpo)": ["--sft.packing", "true", "--preference.loss", "simpo"],
}


def measure(name: str, steps: int, batch: int, seq_len: int) -> dict:
    """One case in this process: trained tokens per second over `steps` steps and peak resident memory."""
    import torch
    import torch.distributed as dist

    from titan_train.config import load_job_config
    from titan_train.distributed import DistInfo
    from titan_train.plan import resolve
    from titan_train.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        flags = [
            "--job.config_file", str(REPO / "apps/configs/debug_dpo.toml"),
            "--job.dump_folder", str(Path(tmp) / "out"),
            "--training.dataset_path", str(REPO / "packages/titan-data/src/titan_data/assets/preference_test/preference_test.jsonl"),
            "--training.local_batch_size", str(batch),
            "--training.seq_len", str(seq_len),
            "--training.steps", str(steps + 1),
            "--metrics.log_freq", "1000",
            *CASES[name],
        ]  # fmt: skip
        trainer = Trainer(resolve(load_job_config(flags), 1, "cpu"), DistInfo(0, 0, 1, torch.device("cpu")))
        trainer.restore()
        trained = 0

        def counted():
            nonlocal trained
            for b in trainer._batches():
                trained += int((b[1] != -100).sum())
                yield b

        batches = counted()
        trainer.train_step(batches)  # warm-up, not counted
        trained = 0
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(batches)
        seconds = time.perf_counter() - start
        dist.destroy_process_group()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "case": name,
        "seconds": seconds,
        "trained": trained,
        "tps": trained / seconds,
        "peak_mib": peak_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=192)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: one case, JSON on stdout
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case, args.steps, args.batch, args.seq_len)))
        return
    rows = []
    for name in CASES:
        cmd = [
            sys.executable,
            __file__,
            "--case",
            name,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
        ]
        out = subprocess.run(
            [*cmd, "--seq-len", str(args.seq_len)], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| case | windows x seq_len | trained tokens | seconds | trained tokens/s | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {args.batch} x {args.seq_len} | {r['trained']:,} | {r['seconds']:.1f} | "
            f"{r['tps']:,.0f} | {r['peak_mib']:,.0f} |"
        )
    print(f"{args.steps} timed steps each; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

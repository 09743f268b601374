"""Expert parallelism on this CPU: tokens/s of ep 2 on 2 ranks against one process, and the all-to-all
bytes a rank sends per step against docs/parallelism.md's formula.

Each run is `titan-train` on `qwen3 tiny_moe` (tests/workers/tiny_moe_flavor.py: 2 MoE layers of 8
experts, top 2, dim 64) at the same local batch per rank: one process, then 2 ranks with FSDP 2 and
ep 2 (the ep ranks borrowed from FSDP). Tokens/s is the median of metrics.jsonl's steps after the
first. The bytes come from separate short runs of the same layouts under a dispatch mode that adds up
what each functional all-to-all sends to other ranks (the token rows of dispatch and combine, forward
and backward; the small exchange of token counts is left out, as the formula leaves it out), once
with the model's own routing and once with `debug.moe_force_load_balance` (round-robin routing: the
balanced case the formula assumes). Formula per step and rank: 4 * t * k * d * b * (ep - 1) / ep per MoE
layer (t tokens on the rank, top-k, dim d, b bytes per element).

    uv run python bench/ep_throughput.py [--steps 20] [--seq-len 256] [--batch 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
DIM, TOP_K, MOE_LAYERS = 64, 2, 2  # tests/workers/tiny_moe_flavor.py


class AllToAllBytes(TorchDispatchMode):
    """Adds up the bytes each functional all-to-all of floating-point rows sends to other ranks."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.sent, self.calls = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default and args[0].is_floating_point():
            rows, send_splits = args[0], args[2]
            row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
            self.sent += sum(n for i, n in enumerate(send_splits) if i != self.rank) * row_bytes
            self.calls += 1
        return func(*args, **(kwargs or {}))


def worker(out: Path, argv: list[str]) -> int:
    """One rank of a counting run: train under AllToAllBytes, then write this rank's totals."""
    from titan_train.cli import main

    rank = int(os.environ.get("RANK", "0"))
    mode = AllToAllBytes(rank)
    with mode:
        status = main(argv)
    Path(f"{out}.rank{rank}").write_text(json.dumps({"sent": mode.sent, "calls": mode.calls}))
    return status


def flags(args, dump: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--job.config_file",
        str(REPO / "apps/configs/qwen3_moe_debug.toml"),
        "--job.dump_folder",
        str(dump),
        "--experimental.custom_import",
        "tiny_moe_flavor",
        "--model.flavor",
        "tiny_moe",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        str(args.batch),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps",
        "2",
        "--activation_checkpoint.mode",
        "none",
        *extra,
    ]


def launch(nproc: int, command: list[str]) -> None:
    from titan_train.torchrun import torchrun_command

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKERS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)),
    }
    proc = subprocess.run(torchrun_command(*command, nproc=nproc), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"a run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def layout_flags(nproc: int) -> list[str]:
    if nproc == 1:
        return []
    return ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]


def tokens_per_second(args, nproc: int, tmp: Path) -> float:
    dump = tmp / f"tps{nproc}"
    launch(nproc, ["-m", "titan_train.cli", *flags(args, dump, args.steps, *layout_flags(nproc))])
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tps"] for r in records if r["step"] > 1)


def bytes_per_step(args, balanced: bool, tmp: Path) -> tuple[float, int]:
    """Rank 0's all-to-all bytes sent per step at ep 2, and its all-to-all calls per step."""
    out, steps = tmp / f"bytes{int(balanced)}", 3
    extra = [*layout_flags(2), *(["--debug.moe_force_load_balance"] if balanced else [])]
    launch(
        2, [__file__, "--worker", str(out), "--", *flags(args, tmp / f"dump{int(balanced)}", steps, *extra)]
    )
    rank0 = json.loads(Path(f"{out}.rank0").read_text())
    return rank0["sent"] / steps, rank0["calls"] // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", type=Path, help="JSON lines: the results")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        sys.exit(worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        one, two = tokens_per_second(args, 1, tmp), tokens_per_second(args, 2, tmp)
        routed, calls = bytes_per_step(args, balanced=False, tmp=tmp)
        balanced, _ = bytes_per_step(args, balanced=True, tmp=tmp)
    t = args.batch * args.seq_len
    formula = MOE_LAYERS * 4 * t * TOP_K * DIM * 4 * (2 - 1) / 2  # float32 rows
    print(
        f"\nqwen3 tiny_moe, batch {args.batch} x seq {args.seq_len} per rank, {args.steps} steps, "
        f"float32, {os.cpu_count()} CPU cores\n"
    )
    print("| layout | tokens/s (all ranks) | tokens/s per rank | vs 1 process |")
    print("|---|---|---|---|")
    print(f"| 1 process | {one:,.0f} | {one:,.0f} | 1.000x |")
    print(f"| FSDP 2, ep 2 | {2 * two:,.0f} | {two:,.0f} | {2 * two / one:.3f}x |")
    print(f"\nall-to-all bytes rank 0 sends per step at ep 2 ({calls} all-to-alls of rows per step):\n")
    print("| routing | measured | formula | measured / formula |")
    print("|---|---|---|---|")
    for name, measured in (("forced balance (round-robin)", balanced), ("the model's own", routed)):
        print(f"| {name} | {measured:,.0f} | {formula:,.0f} | {measured / formula:.3f} |")
    if args.out:
        record = {
            "tps_one": one,
            "tps_ep2_per_rank": two,
            "bytes_balanced": balanced,
            "bytes_routed": routed,
            "formula": formula,
            "calls": calls,
            "batch": args.batch,
            "seq_len": args.seq_len,
        }
        args.out.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

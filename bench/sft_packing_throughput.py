"""Fine-tuning throughput, packed against padded: useful tokens (trained: unmasked and not padding) per second.

The debug model (llama3 debugmodel) trains on the bundled chat file (apps/configs/debug_sft.toml's data)
in this process on a one-rank gloo group, once with `sft.packing = true` and once false, same batch shape
(`--batch` rows x `--seq-len`), `--steps` timed steps after one warm-up step. Useful tokens are counted from
the batches the loader hands out for those steps (labels != -100); padded rows hold one conversation each.

    uv run python bench/sft_packing_throughput.py --steps 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_train.config import load_job_config
from titan_train.distributed import DistInfo
from titan_train.plan import resolve
from titan_train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "packages/titan-data/src/titan_data/assets/chat_test/chat_test.jsonl"


def measure(packing: bool, steps: int, batch: int, seq_len: int, dump: Path, info: DistInfo) -> dict:
    flags = [
        "--job.config_file", str(REPO / "apps/configs/debug_sft.toml"),
        "--job.dump_folder", str(dump),
        "--training.dataset_path", str(DATA),
        "--training.local_batch_size", str(batch),
        "--training.seq_len", str(seq_len),
        "--training.steps", str(steps + 1),
        "--sft.packing", str(packing).lower(),
        "--metrics.log_freq", "1000",
    ]  # fmt: skip
    trainer = Trainer(resolve(load_job_config(flags), 1, "cpu"), info)
    useful = 0

    def counted():
        nonlocal useful
        for batch in trainer._batches():
            useful += int((batch[1] != -100).sum())
            yield batch

    batches = counted()
    trainer.train_step(batches)  # warm-up, not counted
    useful = 0
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batches)
    seconds = time.perf_counter() - start
    return {
        "packing": packing,
        "seconds": seconds,
        "useful": useful,
        "rows": steps * batch,
        "tps": useful / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        rows = [
            measure(p, args.steps, args.batch, args.seq_len, Path(tmp) / str(p), info) for p in (True, False)
        ]
        dist.destroy_process_group()
    print("| sft.packing | steps | rows x seq_len | useful tokens | seconds | useful tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {str(r['packing']).lower()} | {args.steps} | {args.batch} x {args.seq_len} | {r['useful']:,} | "
            f"{r['seconds']:.1f} | {r['tps']:,.0f} |"
        )
    print(
        f"packed / padded: {rows[0]['tps'] / rows[1]['tps']:.2f}x useful tokens/s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()

"""Where one training step's time goes, op by op: torch.profiler over one step (after a warm-up step)
of the plain PyTorch loop or of Titan's `Trainer.train_step`, on the same shape. The two tables side by
side show whether the trainer adds work to a step.

    uv run python bench/profile_step.py --runner plain
    uv run python bench/profile_step.py --runner titan
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]


def plain_step(args):
    sys.path.insert(0, str(REPO / "bench"))
    from plain_pytorch_loop import build, train_step

    model, optimizer, inputs, labels = build(args.flavor, args.batch, args.seq_len)
    return lambda: train_step(model, optimizer, inputs, labels)


def titan_step(args):
    from titan_train.config import load_job_config
    from titan_train.distributed import init_distributed
    from titan_train.plan import resolve
    from titan_train.trainer import Trainer

    config = load_job_config(
        [
            "--job.config_file",
            str(REPO / "apps/configs/debug_model.toml"),
            "--job.dump_folder",
            tempfile.mkdtemp(prefix="titan-profile-"),
            "--model.flavor",
            args.flavor,
            "--training.local_batch_size",
            str(args.batch),
            "--training.seq_len",
            str(args.seq_len),
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    info = init_distributed(60)
    trainer = Trainer(resolve(config, info.world_size, info.device.type), info)
    batches = trainer._batches()
    return lambda: trainer.train_step(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("plain", "titan"), required=True)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()

    step = plain_step(args) if args.runner == "plain" else titan_step(args)
    step()  # warm-up: allocations, lazy initialisation
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
    print(
        f"{args.runner}: one step of {args.flavor} at {args.batch} x {args.seq_len} took "
        f"{time.perf_counter() - start:.2f} s under the profiler\n"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

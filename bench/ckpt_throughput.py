"""How long a checkpoint save holds training up, per async mode, for a ~1 GB training state.

Trains a stack of linear layers with AdamW (weights + two moments = the state) in one process on a
one-rank gloo group, saving every `--interval` steps with titan-ckpt's Checkpointer, and prints:

- blocked: seconds the training loop spent inside the checkpointer for one save (the save call,
  waiting for the host copy before the next optimizer step, waiting for an earlier save);
  the first save of a run also allocates the staging buffers, so it is shown apart;
- write: seconds from the save call until the step folder was complete on disk, and the rate;
- lost per save: wall time of the loop beyond its steps at their median duration, per save
  (this also counts a background writer slowing training down by competing for the CPU; on a
  shared machine it is the noisiest column).

    uv run python bench/ckpt_throughput.py [--gb 1.0] [--saves 4] [--gap 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titan_ckpt import ASYNC_MODES, Checkpointer, ModelState, OptimizerState, SavePolicy

WIDTH = 2048
ROOT = Path(tempfile.gettempdir())  # set by main()


class Progress:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def build(gb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers whose weights plus AdamW's two moments take about `gb` GB."""
    layers = max(1, round(gb * 1e9 / (3 * 4 * WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, optimizer


def step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, ckpt: Checkpointer | None = None
) -> None:
    model(batch).pow(2).mean().backward()
    if ckpt is not None:
        ckpt.wait_for_staging()  # a background copy must finish before the weights change
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def run(mode: str | None, gb: float, saves: int, gap: int) -> dict:
    """Train, saving `saves` times (mode None: never); a save starts once the previous one is on
    disk and `gap` steps have passed, as with a checkpoint interval longer than a write."""
    model, optimizer = build(gb)
    batch = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    step(model, optimizer, batch)  # AdamW's moments exist before the first save
    progress = Progress()
    states = {
        "model": ModelState([model]),
        "optimizer": OptimizerState([model], [optimizer]),
        "train_state": progress,
    }
    # An interval that never comes due: maybe_save then only publishes finished background saves.
    ckpt = (
        None
        if mode is None
        else Checkpointer(ROOT / mode, states, saving=SavePolicy(interval=10**9, async_mode=mode))
    )
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
    step_seconds, started, last_save = [], 0, 0
    start = time.perf_counter()
    while True:
        progress.step += 1
        t = time.perf_counter()
        step(model, optimizer, batch, ckpt)
        step_seconds.append(time.perf_counter() - t)
        if ckpt is None:
            if progress.step >= (saves + 1) * gap:
                break
            continue
        ckpt.maybe_save(progress.step)
        published = len(ckpt.timings)
        if published == saves and progress.step - last_save >= gap:
            break
        if started < saves and published == started and progress.step - last_save >= gap:
            ckpt.save(progress.step)
            started, last_save = started + 1, progress.step
    loop = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()
        shutil.rmtree(ROOT / mode, ignore_errors=True)
    return {
        "loop": loop,
        "steps": progress.step,
        "step_median": statistics.median(step_seconds),
        "timings": ckpt.timings if ckpt else [],
        "state_bytes": state_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gb", type=float, default=1.0, help="training state size in GB (weights + AdamW moments)"
    )
    parser.add_argument(
        "--saves", type=int, default=4, help="saves per mode (the first one is reported apart)"
    )
    parser.add_argument("--gap", type=int, default=3, help="at least this many training steps between saves")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    global ROOT
    ROOT = Path(args.folder or tempfile.mkdtemp(prefix="ckpt_bench_"))
    ROOT.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{ROOT / 'pg_store'}", rank=0, world_size=1)
    load_before = os.getloadavg()[0]

    baseline = run(None, args.gb, args.saves, args.gap)
    results = {mode: run(mode, args.gb, args.saves, args.gap) for mode in ASYNC_MODES}

    state_gb = baseline["state_bytes"] / 1e9
    print(
        f"\ncheckpoint save cost, state {state_gb:.2f} GB (weights + AdamW moments), {args.saves} saves per mode; "
        f"{torch.get_num_threads()} threads, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"one training step alone: {baseline['step_median']:.2f} s (median)"
    )
    header = (
        f"{'async_mode':<23}{'blocked 1st (s)':>16}{'blocked (s)':>13}{'vs sync':>9}{'write (s)':>11}"
        f"{'write MB/s':>12}{'lost/save (s)':>15}"
    )
    print(header)
    print("-" * len(header))
    sync_blocked = None
    for mode, result in results.items():
        timings = result["timings"]
        rest = timings[1:] or timings
        blocked = statistics.median(t.blocked_s for t in rest)
        write = statistics.median(t.total_s for t in rest)
        rate = statistics.median(t.bytes_written / t.total_s for t in rest) / 1e6
        lost = (result["loop"] - result["steps"] * result["step_median"]) / len(timings)
        sync_blocked = sync_blocked or blocked
        print(
            f"{mode:<23}{timings[0].blocked_s:>16.3f}{blocked:>13.3f}{blocked / sync_blocked:>9.3f}{write:>11.2f}"
            f"{rate:>12.0f}{lost:>15.2f}"
        )
    print("blocked: median over saves 2..n; vs sync: blocked / blocked of async_mode=disabled")
    dist.barrier()
    dist.destroy_process_group()
    if args.folder is None:
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()

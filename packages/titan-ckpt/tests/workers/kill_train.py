"""A small training run with checkpoints, meant to be killed with SIGKILL at random moments.

Usage: kill_train.py FOLDER STEPS ASYNC_MODE LOSSES_FILE EVENTS_FILE (or `main(...)` in a fresh process).
Appends to EVENTS_FILE `START <kind> <step> <entries of FOLDER after the load>`, `SAVING <step>`
right before each save, `SAVED <step> <seconds to disk>` once it is published and `DONE <weights hash>`; appends `<step> <loss as float.hex>` to
LOSSES_FILE after every step.
"""

import hashlib
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_ckpt import Checkpointer, ModelState, OptimizerState, SavePolicy

INTERVAL = 2


class ToyData:
    """Batches drawn from a seed per position, so the stream resumes exactly where it stopped."""

    def __init__(self):
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        return torch.randn(16, 512, generator=gen), torch.randn(16, 512, generator=gen)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class Step:
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def weights_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def main(folder: str, steps: int, async_mode: str, losses_file: str, events_file: str) -> None:
    torch.set_num_threads(1)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, progress = ToyData(), Step()
    states = {
        "model": ModelState([model]),
        "optimizer": OptimizerState([model], [optimizer]),
        "dataloader": data,
        "train_state": progress,
    }
    ckpt = Checkpointer(
        folder, states, saving=SavePolicy(interval=INTERVAL, keep_latest_k=3, async_mode=async_mode)
    )
    events = open(events_file, "a", buffering=1)  # line-buffered: each event reaches the file at once
    result = ckpt.load()
    entries = ",".join(sorted(os.listdir(folder))) if os.path.isdir(folder) else ""
    events.write(f"START {result.kind} {result.step} {entries}\n")
    reported = 0
    with open(losses_file, "a") as losses:
        while progress.step < steps:
            inputs, targets = data.next_batch()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            ckpt.wait_for_staging()
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            losses.write(f"{progress.step} {loss.item().hex()}\n")
            losses.flush()
            last = progress.step == steps
            if last or progress.step % INTERVAL == 0:
                events.write(f"SAVING {progress.step}\n")
            ckpt.maybe_save(progress.step, last_step=last)
            for timing in ckpt.timings[reported:]:
                events.write(f"SAVED {timing.step} {timing.total_s:.4f}\n")
            reported = len(ckpt.timings)
    ckpt.close()
    events.write(f"DONE {weights_hash(model)}\n")
    events.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_ckpt import ModelState, OptimizerState


@pytest.fixture
def single_process_group(tmp_path_factory):
    """A real one-rank gloo group, as DCP and the checkpointer use collectives."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Position:
    """A per-run counter standing in for a data loader's or trainer's progress."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class ToyRun:
    """A tiny model, its AdamW optimizer and two progress counters, as a trainer would hold them."""

    def __init__(self, seed: int = 0, hidden: int = 16):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.data, self.progress = Position(), Position()

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState([self.model]),
            "optimizer": OptimizerState([self.model], [self.optimizer]),
            "dataloader": self.data,
            "train_state": self.progress,
        }

    def train(self, steps: int, before_optimizer_step: Callable[[], None] = lambda: None) -> list[float]:
        """`steps` steps; `before_optimizer_step` is a checkpointer's `wait_for_staging`, as a trainer calls it."""
        losses = []
        for _ in range(steps):
            gen = torch.Generator().manual_seed(self.data.value)
            self.data.value += 1
            loss = self.model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            loss.backward()
            before_optimizer_step()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.progress.value += 1
            losses.append(loss.item())
        return losses

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return [t.clone() for s in self.optimizer.state.values() for t in s.values()]


@pytest.fixture
def toy_run():
    return ToyRun


def same_tensors(a, b) -> bool:
    """Bit-for-bit equality of two dicts or lists of tensors."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def same():
    return same_tensors

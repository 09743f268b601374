"""One replica group of one rank training a small model under `semi_sync_method` through Titan's
`ReplicaGroup` (torchft's LocalSGD or DiLoCo), as tests/test_fault_tolerance_semi_sync.py runs two of them.

    python semi_sync_group.py REPLICA_ID METHOD SYNC_STEPS ROUNDS OUT.pt [NUM_FRAGMENTS]   (TORCHFT_LIGHTHOUSE set)

OUT.pt holds the final weights; OUT.pt.steps the weights after every step (a list).

Group r's batch at step t is drawn from generator seed 1000 * r + t (`batch`), so the test can replay it.
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from titan_train.config.fault_tolerance_section import FaultTolerance
from titan_train.fault_tolerance import HealState, ReplicaGroup

LR = 1e-2


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)

    def pipeline_units(self) -> list[str]:
        return ["inp", "out"]

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def build() -> tuple[Toy, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Toy()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def main(replica: int, method: str, sync_steps: int, rounds: int, out: str, num_fragments: int = 1) -> None:
    settings = FaultTolerance(
        enable=True,
        group_size=2,
        replica_id=replica,
        semi_sync_method=method,
        sync_steps=sync_steps,
        num_fragments=num_fragments,
    )
    steps = []
    model, optimizer = build()
    group = ReplicaGroup(settings, rank=0, world_size=1, dump=Path(tempfile.mkdtemp()), semi_sync=True)
    group.register(HealState([model], [optimizer], {}))
    with group.training([model], [optimizer]):
        for step in range(sync_steps * rounds):
            optimizer.zero_grad()
            x, y = batch(replica, step)
            nn.functional.mse_loss(model(x), y).backward()
            group.begin_step()
            group.average_gradients(list(model.parameters()))
            assert group.commit(step + 1)
            optimizer.step()
            steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    torch.save(steps[-1], out)
    torch.save(steps, out + ".steps")
    group.close()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
        *map(int, sys.argv[6:]),
    )

"""torchrun worker (2 gloo ranks): a toy model split column- and row-wise, gathered into its unparallelised copy
by `fill_whole`; rank 0 writes what the copy holds against the unsplit model to OUT (JSON)."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_parallel import fill_whole


class Toy(nn.Module):
    """An embedding tied to the output layer, two linears to split, a non-persistent buffer."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.w1, self.w2 = nn.Linear(8, 12), nn.Linear(12, 8)
        self.output = nn.Linear(8, 16, bias=False)
        self.output.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(8.0), persistent=False)
        if extra:
            self.missing = nn.Linear(2, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.w2(torch.relu(self.w1(self.embed(ids)))) * self.scale)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = Toy()
        whole = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        with torch.device("meta"):
            target = Toy()
        fill_whole(target, model)
        ids = torch.tensor([[1, 5, 7, 2]])
        result = {
            "weights": all(torch.equal(target.state_dict()[k], v) for k, v in whole.state_dict().items()),
            "tied": target.output.weight is target.embed.weight,
            "buffer": torch.equal(target.scale, whole.scale),
            "eval": not target.training,
            "same_output": torch.allclose(target(ids), whole(ids), atol=1e-6),
        }
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

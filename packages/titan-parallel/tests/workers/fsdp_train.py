"""Train a small torch.nn model (not a Titan model) for a few steps, with FSDP when world > 1.

Run under torchrun; writes the per-step losses and gradient norms as JSON to argv[1] (rank 0).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from titan_parallel import ParallelDims, apply_fsdp, blocks_of, clip_grad_norm_


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, dim=32, n_blocks=3, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab)

    def parallel_blocks(self):
        return {f"blocks.{i}": b for i, b in enumerate(self.blocks)}

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack()  # same full init on every rank; fully_shard keeps each rank's slice
    if world > 1:
        dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=world)
        dims.build_mesh("cpu")
        apply_fsdp(model, blocks_of(model), dims.submesh("dp_shard"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    global_batch = 8
    records = []
    for _ in range(5):
        tokens = torch.randint(0, 50, (global_batch, 17), generator=data)
        local = tokens.chunk(world)[rank]
        logits = model(local[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        records.append({"loss": mean_loss.item() / world, "grad_norm": norm.item()})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

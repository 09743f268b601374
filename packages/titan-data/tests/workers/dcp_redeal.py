"""Worker for test_checkpoint_redeal.py, on 3 gloo ranks: 2 of them read 3 steps and save the loader
state with torch.distributed.checkpoint (each writes only its own streams); then all 3, and then 1 rank,
load that checkpoint and read on. Every rank writes the windows it read to OUT/<phase>_rank<r>.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_data import PackedTokenDataset, StreamLayout, TokenLoader, build_tokenizer, get_source
from titan_data.datasets.registry import ASSETS

NUM_STREAMS, GLOBAL_BATCH, SEQ_LEN, SAVED_STEPS, RESUMED_STEPS = 12, 12, 32, 3, 4


def loader(rank: int, world: int) -> TokenLoader:
    dataset = PackedTokenDataset(
        get_source("c4_test"),
        build_tokenizer(ASSETS / "tokenizer"),
        SEQ_LEN,
        streams=StreamLayout(rank, world, NUM_STREAMS),
    )
    return TokenLoader(dataset, GLOBAL_BATCH // world)


def read(loader: TokenLoader, steps: int) -> list[list[list[int]]]:
    it = iter(loader)
    batches = []
    for _ in range(steps):
        inputs, labels = next(it)
        batches.append(torch.cat([inputs, labels[:, -1:]], dim=1).tolist())
    return batches


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {world: dist.new_group(list(range(world))) for world in (1, 2, 3)}  # created by every rank
    if rank < 2:
        first = loader(rank, 2)
        (out / f"saved_rank{rank}.json").write_text(json.dumps(read(first, SAVED_STEPS)))
        dcp.save({"dataloader": first}, checkpoint_id=str(out / "checkpoint"), process_group=groups[2])
    dist.barrier()
    for world in (3, 1):
        if rank < world:
            resumed = loader(rank, world)
            dcp.load(
                {"dataloader": resumed}, checkpoint_id=str(out / "checkpoint"), process_group=groups[world]
            )
            (out / f"world{world}_rank{rank}.json").write_text(json.dumps(read(resumed, RESUMED_STEPS)))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

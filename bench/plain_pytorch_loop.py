"""The floor any trainer must beat on one process: a plain eager PyTorch training loop.

Same model as Titan's (titan_models' Llama 3 flavor), AdamW, cross-entropy and grad-norm clipping,
on random tokens (no data loading at all), one process, no distributed wrapper. Prints one JSON
line per step with the step time, for bench/train_throughput.py.

    uv run python bench/plain_pytorch_loop.py --flavor debugmodel --batch 8 --seq-len 2048 --steps 6
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from titan_models import Transformer, llama3_args


def build(flavor: str, batch: int, seq_len: int):
    """The model, optimizer and one batch of random tokens, on the GPU if there is one."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model_args = llama3_args(flavor)
    model_args.max_seq_len = seq_len
    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device, seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True
    )
    tokens = torch.randint(0, model_args.vocab_size, (batch, seq_len + 1), device=device)
    return model, optimizer, tokens[:, :-1], tokens[:, 1:]


def train_step(model, optimizer, inputs, labels) -> float:
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()  # a host sync, as any loop that logs its loss has


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    model, optimizer, inputs, labels = build(args.flavor, args.batch, args.seq_len)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss_value = train_step(model, optimizer, inputs, labels)
        seconds = time.perf_counter() - start
        cuda = torch.cuda.is_available()
        record = {
            "step": step,
            "loss": loss_value,
            "seconds": seconds,
            "tps": args.batch * args.seq_len / seconds,
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

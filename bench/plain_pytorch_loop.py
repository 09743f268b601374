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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model_args = llama3_args(args.flavor)
    model_args.max_seq_len = args.seq_len
    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device, seed=0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True
    )
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()  # a host sync, as any loop that logs its loss has
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        record = {
            "step": step,
            "loss": loss_value,
            "seconds": seconds,
            "tps": args.batch * args.seq_len / seconds,
            "memory_gib": peak,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

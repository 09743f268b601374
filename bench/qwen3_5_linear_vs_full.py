"""CPU time of one Qwen3.5 token mixer's training step (forward and backward) by sequence length: a Gated
DeltaNet linear-attention layer against a gated full-attention layer of the same flavor.

Each layer is built alone from the flavor's args (`--flavor`, default the debug model: dim 256, full
attention of 4 heads of 64, linear attention of 8 value heads with 32 x 32 states), random weights, batch
1, float32, eager; a step is `layer(x).square().mean().backward()`. The figure is the median process CPU
time of `--repeats` steps after one warm-up, with `--threads` torch threads.

    uv run python bench/qwen3_5_linear_vs_full.py --seqs 512 2048 8192 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_models.qwen3_5 import HybridMasks, qwen3_5_args
from titan_models.qwen3_5.attention import GatedAttention
from titan_models.qwen3_5.linear_attention import GatedDeltaNet
from titan_models.rope import rotary_frequencies


def _cpu_seconds(layer: torch.nn.Module, x: torch.Tensor, freqs: torch.Tensor, repeats: int) -> float:
    masks = HybridMasks(None, None)
    times = []
    for i in range(repeats + 1):
        x.grad = None
        start = time.process_time()
        layer(x, freqs, masks).square().mean().backward()
        if i:
            times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    args = qwen3_5_args(a.flavor)
    print("| seq | linear attention (s) | full attention (s) | full / linear |")
    print("|---|---|---|---|")
    for seq in a.seqs:
        args.max_seq_len = seq
        freqs = rotary_frequencies(args.rotary_dim, seq, args.rope_theta)
        x = torch.randn(1, seq, args.dim, requires_grad=True)
        linear, full = GatedDeltaNet(args), GatedAttention(args)
        for layer in (linear, full):
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            linear.A_log.uniform_(0.0, 2.0)
            linear.dt_bias.fill_(1.0)
        t_linear, t_full = _cpu_seconds(linear, x, freqs, a.repeats), _cpu_seconds(full, x, freqs, a.repeats)
        print(f"| {seq:,} | {t_linear:.3f} | {t_full:.3f} | {t_full / t_linear:.2f} |")


if __name__ == "__main__":
    main()

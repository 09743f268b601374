"""Matmul FLOPs one rank computes in one training step of a config, counted on the dry run's traced step.

The dry run (`titan-train dry-run`) traces one training step of rank 0 on fake tensors for its memory
estimate; this runs the same step (`titan_train.reporting.traced_memory.trace_rank`) and counts, on the
tensors the rank holds (DTensors unwrapped to their local shards), the FLOPs of every matmul and attention
kernel (torch's `flop_registry`, plus grouped matmuls): forward, backward and activation-checkpointing
recomputation alike. It traces the model cut to 1 and to 2 blocks and scales the difference (one block)
to the model's depth, so it suits models whose blocks are all alike (Llama 4 17bx16e). Used for the
shared experts before and after they were split over tensor parallelism (bench/RESULTS.md); run it from
the worktree whose code is to be measured:

    uv run python /path/to/bench/per_rank_flops.py --ngpu 64 --job.config_file apps/configs/llama4_17bx16e.toml
"""

from __future__ import annotations

import argparse
import time

import torch
from torch._guards import active_fake_mode
from torch.utils.flop_counter import flop_registry

from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.reporting import traced_memory


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """2 x multiply-adds of `torch._grouped_mm`: (T, K) x (E, K, N) -> (T, N), or the weight gradient
    (K, T) x (T, N) -> (E, K, N), whose groups split T."""
    groups = out.shape[0] if out.dim() == 3 and a.dim() == 2 and b.dim() == 2 else 1
    return 2 * out.numel() // groups * a.shape[-1]


def counting_trace(flops: list[int]) -> type:
    """The dry run's memory trace, also adding each local op's FLOPs to `flops[0]`."""

    class CountingTrace(traced_memory.MemoryTrace):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is NotImplemented:  # a DTensor: its local ops come back here
                return out
            # DTensor's sharding propagation runs ops on global shapes to learn its outputs' (cached, so
            # only the first trace would count them): no rank computes those.
            if self._propagating or active_fake_mode() is not self._fake_mode_on_entry:
                return out
            packet = func._overloadpacket
            if packet in flop_registry:
                n = flop_registry[packet](*args, **(kwargs or {}), out_val=out)
            elif "grouped_mm" in str(packet):
                n = _grouped_mm_flops(args[0], args[1], out)
            else:
                return out
            flops[0] += n
            return out

    return CountingTrace


def traced_flops(plan, n_layers: int) -> int:
    """FLOPs rank 0 computes in the traced step of the model cut to `n_layers` blocks."""
    flops = [0]
    # trace_step makes its trace from this module-level name: the dry run's step, counted.
    traced_memory.MemoryTrace = counting_trace(flops)
    traced_memory.trace_rank(plan, 0, n_layers=n_layers)
    return flops[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ngpu", type=int, required=True)
    known, overrides = parser.parse_known_args()
    plan = resolve(load_job_config(overrides), known.ngpu, "cuda")
    start = time.perf_counter()
    one, two = traced_flops(plan, 1), traced_flops(plan, 2)
    seconds = time.perf_counter() - start
    n_layers = plan.model_args.n_layers
    block, outside = two - one, 2 * one - two
    total = outside + n_layers * block
    tokens = plan.config.training.local_batch_size * plan.train_seq_len
    print(f"{plan.config.model.name} {plan.config.model.flavor} on {known.ngpu} ranks, {plan.dims}")
    print(f"rank 0, one training step (1 and 2 blocks traced in {seconds:.0f} s, scaled to {n_layers}):\n")
    print("| part | TFLOP per step | GFLOP per token of the rank's batch |")
    print("|---|---:|---:|")
    for name, n in (
        ("one block", block),
        ("outside the blocks", outside),
        (f"the step ({n_layers} blocks and the rest)", total),
    ):
        print(f"| {name} | {n / 1e12:.2f} | {n / tokens / 1e9:.3f} |")
    print(
        f"\nthe model's FLOPs per token (plan.flops_per_token, MFU's numerator): {plan.flops_per_token / 1e9:.3f} G"
    )


if __name__ == "__main__":
    main()

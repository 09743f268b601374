"""Llama 3.2 1B and 3B with an untied output matrix, for both trainers in bench/gpu_throughput.py.

torchtitan 0.2.2 (the release that runs on the GPU machine's torch 2.11) has no 1B/3B flavors and cannot
tie the output projection to the embedding, so the benchmark trains the published shapes untied in
both trainers: the same parameters, FLOPs and optimizer state. Each trainer imports this file through
`--experimental.custom_import untied_flavors`; it registers `1B_untied` and `3B_untied` with the trainer
that imports it, and makes torchtitan print the peak active bytes beside its log line.
"""

from __future__ import annotations

import sys

# The Llama 3.2 shapes (vocabulary 128256, rope theta 500000) as published by Meta.
SHAPES = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256),
}


def _register_titan() -> None:
    from titan_train.registry import get_model_family, register_flavor

    llama3 = get_model_family("llama3")
    for name in SHAPES:
        register_flavor("llama3", f"{name}_untied", llama3.args_for(name, tie_word_embeddings=False))


def _register_torchtitan() -> None:
    import torch
    from torchtitan.components import metrics
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    for name, shape in SHAPES.items():
        llama3_args[f"{name}_untied"] = TransformerModelArgs(rope_theta=500000, vocab_size=128256, **shape)

    # torchtitan logs peak reserved bytes on its line and peak active bytes only to TensorBoard.
    get_peak_stats = metrics.DeviceMemoryMonitor.get_peak_stats

    def print_active_too(self):
        stats = get_peak_stats(self)
        peak = torch.cuda.memory_stats(self.device).get("active_bytes.all.peak", 0)
        print(f"bench-memory: active {peak / 2**30:.3f} GiB", flush=True)
        return stats

    metrics.DeviceMemoryMonitor.get_peak_stats = print_active_too


# Register with the trainer that is importing this file (both may be installed).
if "titan_train" in sys.modules:
    _register_titan()
if "torchtitan" in sys.modules:
    _register_torchtitan()

"""Config values the trainer cannot honour yet: refused up front, never silently ignored.

Each rule names the setting, why it cannot run, and the value that does. When a feature gets wired
into the trainer, its rule is deleted here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titan_parallel.mx import missing_mx_matmuls, mx_recipe_is_emulated
from titan_train.config.converters import MX
from titan_train.errors import ConfigError


class UnsupportedConfigError(ConfigError):
    """A valid config value that this build of the trainer does not apply."""


@dataclass(frozen=True)
class _Rule:
    applies: Callable[[Any], bool]
    setting: Callable[[Any], str]
    reason: str
    fix: str


_RULES = (
    _Rule(
        lambda c: (
            c.validation.enable
            and c.parallelism.pipeline_parallel_degree > 1
            and (c.validation.local_batch_size, c.validation.seq_len)
            != (c.training.local_batch_size, c.training.seq_len)
        ),
        lambda c: (
            f"validation.local_batch_size/seq_len ({c.validation.local_batch_size}, {c.validation.seq_len}) "
            "with pipeline_parallel_degree > 1"
        ),
        "pipeline stages exchange activations in buffers shaped by the training batch, which validation reuses",
        "set validation.local_batch_size and validation.seq_len to training's",
    ),
    _Rule(
        lambda c: c.validation.enable and c.validation.dataloader.persistent_workers,
        lambda c: "validation.dataloader.persistent_workers = true",
        "each validation reads a fresh loader from the start (so every validation sees the same data), and "
        "its workers end with it; there is no next pass of that loader for them to persist into",
        "set it to false",
    ),
    _Rule(
        lambda c: c.parallelism.expert_parallel_comm_backend == "deepep",
        lambda c: "parallelism.expert_parallel_comm_backend = 'deepep'",
        "DeepEP's all-to-all kernels are not wired into Titan, which dispatches tokens with torch's all-to-all",
        "use 'standard'",
    ),
    _Rule(
        lambda c: c.comm.mode == "local_tensor",
        lambda c: "comm.mode = 'local_tensor'",
        "torch's LocalTensorMode cannot run FSDP2, Titan's data-parallel layer (its forward frees each "
        "unsharded parameter with storage.resize_(0), which a LocalTensor's storage refuses, torch 2.15; "
        "torchtitan 0.2.2 builds its model in this mode and skips training), and every simulated rank would "
        "read one process's batch",
        "use comm.mode = 'fake_backend' (a dry run: the plan, memory and layout checks for NGPU ranks) or run "
        "the ranks with torchrun --nproc_per_node N on CPU (gloo)",
    ),
    _Rule(
        lambda c: (
            c.activation_checkpoint.mode == "memory_budget"
            and not (c.compile.enable and "model" in c.compile.components)
        ),
        lambda c: "activation_checkpoint.mode = 'memory_budget'",
        "a memory budget is applied by torch.compile's min-cut partitioner, so the model must be compiled",
        "set compile.enable = true with 'model' in compile.components, or use mode 'selective' or 'full'",
    ),
    _Rule(
        lambda c: c.metrics.enable_wandb and importlib.util.find_spec("wandb") is None,
        lambda c: "metrics.enable_wandb = true",
        "the wandb package is not installed",
        "pip install wandb, or set metrics.enable_wandb = false",
    ),
)


def refuse_unsupported(config: Any, device_type: str) -> None:
    """Raise UnsupportedConfigError for the first setting the trainer cannot honour on `device_type`."""
    for rule in _RULES:
        if rule.applies(config):
            raise UnsupportedConfigError(f"config: {rule.setting(config)}: {rule.reason}; {rule.fix}")
    mx = config.quantize.linear.mx
    if MX in config.model.converters and not mx_recipe_is_emulated(mx.recipe_name):
        missing = missing_mx_matmuls(device_type)
        if missing is not None:
            raise UnsupportedConfigError(
                f"config: quantize.linear.mx.recipe_name = {mx.recipe_name!r} needs MXFP8 matmuls, on a CUDA GPU "
                f"of compute capability 10.0 or newer (B200, GB200), and this run is on {missing}; use "
                "recipe_name = 'mxfp8_emulated' to test MX numerics here, or quantize.linear.float8"
            )
    ft = config.fault_tolerance
    if ft.enable and ft.should_quantize and device_type != "cuda":
        raise UnsupportedConfigError(
            f"config: fault_tolerance.should_quantize = true on {device_type}: torchft quantizes with Triton "
            "kernels on CUDA only; set it to false"
        )
    if ft.enable and ft.process_group == "nccl" and device_type != "cuda":
        raise UnsupportedConfigError(
            f"config: fault_tolerance.process_group = 'nccl' on {device_type}: NCCL needs CUDA GPUs; use 'gloo'"
        )
    if config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise UnsupportedConfigError(
            "config: profiling.enable_memory_snapshot = true: memory snapshots record the CUDA caching "
            f"allocator, and this run is on {device_type}; set it to false (profiling.enable_profiling "
            "traces work everywhere)"
        )

"""Initial weights of a model with MoE layers (Qwen3, Llama 4): Titan's Llama rules plus the MoE rule.

As in `titan_models.init`, every parameter is drawn at its full shape from a generator seeded by the
run's seed and its name, so the weights do not depend on the parallel layout (expert-parallel and
FSDP shards keep their slice). MoE parameters follow `titan_models.moe.moe_init_std`; the rest follow
Llama's `filler_for`.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.init import Filler, _local_slice, _trunc_normal, filler_for
from titan_models.moe import moe_init_std

_LAYER = re.compile(r"layers\.(\d+)\.")


def moe_model_filler(name: str, args: Any) -> Filler:
    """How the parameter `name` is initialised: the MoE rule inside MoE layers, Llama's elsewhere."""
    layer = _LAYER.search(name)
    if layer and ".moe." in name:
        depth = int(layer.group(1)) + 1 if args.depth_init else args.n_layers
        std = moe_init_std(name.split(".moe.", 1)[1], 0.02 / (2 * depth) ** 0.5)
        if std is not None:
            return _trunc_normal(std)
    return filler_for(name, args)


@torch.no_grad()
def init_moe_model(model: nn.Module, args: Any, seed: int, buffer_device: torch.device) -> None:
    """Fill every parameter from `seed` and its name, and zero the MoE layers' expert bias and counts."""
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        moe_model_filler(name, args)(full, generator)
        local.copy_(_local_slice(full, param) if isinstance(param, DTensor) else full)
    for moe in model.moe_layers().values():
        moe.init_buffers(buffer_device)

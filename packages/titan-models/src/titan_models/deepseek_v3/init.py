"""DeepSeek-V3's initial weights (torchtitan 0.2.2's distributions), identical for every parallel layout.

As for Llama (`titan_models.init`), each parameter is drawn at its full shape from a generator seeded by
the run's seed and the parameter's name, and a rank holding a shard keeps its slice.
"""

from __future__ import annotations

import re
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.errors import ModelConfigError
from titan_models.init import Filler, _local_slice, _trunc_normal
from titan_models.moe import moe_init_std

_LAYER = re.compile(r"layers\.(\d+)\.")
_INPUT_PROJECTIONS = ("wq.weight", "wq_a.weight", "wq_b.weight", "wkv_a.weight", "wkv_b.weight", "w1.weight")


def deepseek_filler(name: str, args: DeepSeekV3Args) -> Filler:
    """How the parameter called `name` is initialised.

    Output-side projections of a block (`wo`, `w2`, `w3`, experts' too, and the router) use
    0.02 / sqrt(2 * (layer + 1)); input projections 0.02; norms start at one.
    """
    if name.endswith("norm.weight"):
        return lambda t, g: nn.init.ones_(t)
    if name == "tok_embeddings.weight":
        return lambda t, g: nn.init.normal_(t, generator=g)
    if name == "output.weight":
        std = args.dim**-0.5
        return _trunc_normal(std, bound=3 * std)
    layer = _LAYER.search(name)
    if layer:
        depth = int(layer.group(1)) + 1 if args.depth_init else args.n_layers
        depth_std = 0.02 / (2 * depth) ** 0.5
        if ".moe." in name:
            std = moe_init_std(name, depth_std)
            if std is not None:
                return _trunc_normal(std)
        elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
            return _trunc_normal(depth_std)
        elif name.endswith(_INPUT_PROJECTIONS):
            return _trunc_normal(0.02)
    raise ModelConfigError(f"model: no initialisation rule for parameter '{name}'")


@torch.no_grad()
def init_deepseek_parameters(model: nn.Module, args: DeepSeekV3Args, seed: int) -> None:
    """Fill every parameter of `model` (plain or DTensor, on any device) from `seed` and its name."""
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        deepseek_filler(name, args)(full, generator)
        local.copy_(_local_slice(full, param) if isinstance(param, DTensor) else full)

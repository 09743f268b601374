"""Weight initialisation as in Llama pretraining, identical for every parallel layout.

Each parameter is drawn from its own generator, seeded by the run's seed and the parameter's
name, and always at its full (global) shape; a rank holding a shard (an FSDP or TP DTensor)
keeps its slice. The initial weights therefore do not depend on how many ranks there are, how
the model is split, or in which order parameters are visited.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.errors import ModelConfigError
from titan_models.moe.init import moe_init_std

Filler = Callable[[torch.Tensor, torch.Generator], None]
_LAYER = re.compile(r"layers\.(\d+)\.")
# LoRA adapters (lora_A, lora_B) added by a model converter fill themselves (titan_parallel.init_lora).
_ADAPTER = re.compile(r"\.lora_[AB]\.weight$")
# Parameter-name endings of the projections that read a block's input (Llama's, Qwen3's, Llama 4's).
INPUT_PROJECTIONS = ("wq.weight", "wk.weight", "wv.weight", "w1.weight")
# Parameter-name endings drawn with the block's depth-scaled std (output projections, as in Llama).
DEPTH_SCALED = ("wo.weight", "w2.weight", "w3.weight")


def trunc_normal(std: float, bound: float = 2.0) -> Filler:
    """Normal(0, std) truncated to [-bound, bound] (absolute, as nn.init's default of 2)."""
    return lambda t, g: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-bound, b=bound, generator=g)


def filler_for(
    name: str,
    args: Any,
    input_projections: tuple[str, ...] = INPUT_PROJECTIONS,
    depth_scaled: tuple[str, ...] = DEPTH_SCALED,
) -> Filler:
    """How the parameter called `name` is initialised (any decoder family's `args`).

    Output projections of attention and feed-forward (`wo`, `w2`, `w3`) shrink with depth,
    0.02 / sqrt(2 * (layer + 1)), so the residual stream's variance stays bounded (a family may name
    more `depth_scaled` endings: gpt-oss draws its whole attention so); parameters inside an MoE
    layer follow `titan_models.moe.moe_init_std`; `input_projections` draw with std 0.02.
    """
    if name.endswith("norm.weight"):
        return lambda t, g: nn.init.ones_(t)
    if name == "tok_embeddings.weight" and not args.tie_word_embeddings:
        return lambda t, g: nn.init.normal_(t, generator=g)
    # A tied matrix is drawn once, under the embedding's name, by the output rule: unit-variance
    # embeddings would make the initial logits sqrt(dim) times too large.
    if name in ("output.weight", "tok_embeddings.weight"):
        std = args.dim**-0.5
        return trunc_normal(std, bound=3 * std)
    layer = _LAYER.search(name)
    if layer:
        depth = int(layer.group(1)) + 1 if args.depth_init else args.n_layers
        depth_std = 0.02 / (2 * depth) ** 0.5
        if ".moe." in name:
            std = moe_init_std(name, depth_std)
            if std is not None:
                return trunc_normal(std)
        elif name.endswith(depth_scaled):
            return trunc_normal(depth_std)
        elif name.endswith(input_projections):
            return trunc_normal(0.02)
    raise ModelConfigError(f"model: no initialisation rule for parameter '{name}'")


def _local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index]


@torch.no_grad()
def init_parameters(
    model: nn.Module,
    args: Any,
    seed: int,
    *,
    input_projections: tuple[str, ...] = INPUT_PROJECTIONS,
    depth_scaled: tuple[str, ...] = DEPTH_SCALED,
    draw_dtype: torch.dtype | None = None,
    family_filler: Callable[[str], Filler | None] | None = None,
) -> None:
    """Fill every parameter of `model` (plain or DTensor, on any device) from `seed` and its name.

    `draw_dtype` is the dtype a full tensor is drawn in before the copy (None: the parameter's own);
    DeepSeek-V3 draws in float32, as it always has. `family_filler(name)` is asked first and may name a
    family's own rule (Qwen3.5's zero-centred norms, decay rates, convolution); None: `filler_for`'s.
    LoRA adapters are left to the converter that added them.
    """
    for name, param in model.named_parameters():
        if _ADAPTER.search(name):
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        full = torch.empty(param.shape, dtype=draw_dtype or local.dtype, device=local.device)
        own = family_filler(name) if family_filler is not None else None
        (own or filler_for(name, args, input_projections, depth_scaled))(full, generator)
        local.copy_(_local_slice(full, param) if isinstance(param, DTensor) else full)

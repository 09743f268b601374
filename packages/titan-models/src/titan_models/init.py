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

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.args import ModelArgs
from titan_models.errors import ModelConfigError

Filler = Callable[[torch.Tensor, torch.Generator], None]
_LAYER = re.compile(r"layers\.(\d+)\.")


def _trunc_normal(std: float, bound: float = 2.0) -> Filler:
    """Normal(0, std) truncated to [-bound, bound] (absolute, as nn.init's default of 2)."""
    return lambda t, g: nn.init.trunc_normal_(t, mean=0.0, std=std, a=-bound, b=bound, generator=g)


def filler_for(name: str, args: ModelArgs) -> Filler:
    """How the parameter called `name` is initialised.

    Output projections of attention and feed-forward (`wo`, `w2`, `w3`) shrink with depth,
    0.02 / sqrt(2 * (layer + 1)), so the residual stream's variance stays bounded.
    """
    if name.endswith("norm.weight"):
        return lambda t, g: nn.init.ones_(t)
    if name == "tok_embeddings.weight" and not args.tie_word_embeddings:
        return lambda t, g: nn.init.normal_(t, generator=g)
    # A tied matrix is drawn once, under the embedding's name, by the output rule: unit-variance
    # embeddings would make the initial logits sqrt(dim) times too large.
    if name in ("output.weight", "tok_embeddings.weight"):
        std = args.dim**-0.5
        return _trunc_normal(std, bound=3 * std)
    layer = _LAYER.search(name)
    if layer and name.endswith(("wo.weight", "w2.weight", "w3.weight")):
        depth = int(layer.group(1)) + 1 if args.depth_init else args.n_layers
        return _trunc_normal(0.02 / (2 * depth) ** 0.5)
    if layer and name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
        return _trunc_normal(0.02)
    raise ModelConfigError(f"model: no initialisation rule for parameter '{name}'")


def _local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index]


@torch.no_grad()
def init_parameters(model: nn.Module, args: ModelArgs, seed: int) -> None:
    """Fill every parameter of `model` (plain or DTensor, on any device) from `seed` and its name."""
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        full = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        filler_for(name, args)(full, generator)
        local.copy_(_local_slice(full, param) if isinstance(param, DTensor) else full)

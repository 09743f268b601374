"""A parallelised model's weights, gathered whole into an unparallelised copy of it.

Generation under tensor or expert parallelism runs the decode loop one token at a time, with shapes that
the layouts' collectives (sequence-parallel norms, expert all-to-alls) were not built for, and under expert
parallelism each rank decodes its own prompts for its own number of steps. A plain copy holding every weight
whole decodes with no collective at all, as one process does; it costs the memory of FSDP's unshard (one
whole model per rank) for as long as the copy lives.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_parallel.errors import ModelDescriptionError
from titan_parallel.parameter_names import plain_name


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    # full_tensor gathers over every mesh dimension the tensor is split on (tp, ep, FSDP's shards).
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def fill_whole(target: nn.Module, source: nn.Module) -> nn.Module:
    """Give `target` (the model of `source` without its parallelisms, on the meta device) each of
    `source`'s parameters and buffers as one whole tensor, in its own dtype; returns `target` in eval mode.

    Every rank of `source`'s meshes must call it (the gathers are collectives), in the same order. Tied
    weights stay tied: a tensor reached by two names is gathered once."""
    held = {
        plain_name(name): tensor
        for name, tensor in chain(
            source.named_parameters(remove_duplicate=False), source.named_buffers(remove_duplicate=False)
        )
    }
    gathered: dict[int, torch.Tensor] = {}
    slots = [(name, True) for name, _ in target.named_parameters(remove_duplicate=False)]
    slots += [(name, False) for name, _ in target.named_buffers(remove_duplicate=False)]
    for name, is_parameter in slots:
        if name not in held:
            raise ModelDescriptionError(
                f"whole copy: {name} of the unparallelised model is not in the parallelised one; build both "
                "from the same model arguments and converters"
            )
        tensor = held[name]
        if id(tensor) not in gathered:
            whole = _whole(tensor)
            gathered[id(tensor)] = nn.Parameter(whole, requires_grad=False) if is_parameter else whole
        owner, _, attr = name.rpartition(".")
        slot = (
            target.get_submodule(owner)._parameters if is_parameter else target.get_submodule(owner)._buffers
        )
        slot[attr] = gathered[id(tensor)]
    return target.eval()

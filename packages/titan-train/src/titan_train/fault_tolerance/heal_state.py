"""What a live replica group sends a healing one: this rank's shard of the training state, as plain tensors.

torchft pairs group rank r of the live group with group rank r of the healing one, and both groups lay
the model out alike, so each rank's local shards (the `to_local()` of every DTensor) are exactly what its
peer holds. Plain tensors travel through torchft's checkpoint transport without a device mesh. The data
loader is not part of it: each group keeps its own position in the data, as torchtitan's groups do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: its local shard if it is a DTensor, else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    # On CPU torchft's transport serves the tensors it is given, not copies: the optimizer may step while a
    # peer still reads them, so the live state is copied at the step it is sent for.
    return local_shard(t).detach().clone()


class HealState:
    """This rank's model shards, optimizer state and the run's small states (lr schedules, train state),
    read for a healing peer (`state_dict`) and written from a live one (`load_state_dict`)."""

    def __init__(self, parts: list[nn.Module], optimizers: list[Optimizer], others: Mapping[str, Stateful]):
        self.optimizers, self.others = optimizers, dict(others)
        # Taken once, at rest: torchft reads the state from its quorum thread while the forward pass runs,
        # when FSDP has swapped unsharded tensors into the modules. The sharded parameters (and persistent
        # buffers) listed here are the objects that hold the state throughout.
        self.model = [part.state_dict(keep_vars=True) for part in parts]
        self.params = [list(part.named_parameters()) for part in parts]

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the state in a fixed order, under a stable name (the live ones, not copies)."""
        for i, tensors in enumerate(self.model):
            for name, t in tensors.items():
                yield f"model.{i}.{name}", local_shard(t)
        for i, (params, optimizer) in enumerate(zip(self.params, self.optimizers, strict=True)):
            for name, p in params:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        yield f"optimizer.{i}.{name}.{key}", local_shard(value)

    def state_dict(self) -> dict[str, Any]:
        return {
            "tensors": {name: _snapshot(t) for name, t in self._tensors()},
            "param_groups": [[dict(g, params=None) for g in o.param_groups] for o in self.optimizers],
            **{key: state.state_dict() for key, state in self.others.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Write a live peer's state into this rank's; return the bytes of tensors received."""
        received = state["tensors"]
        self._make_optimizer_state(received)
        here = dict(self._tensors())
        if here.keys() != received.keys():
            differ = sorted(set(received) ^ set(here))[:3]
            raise RuntimeError(
                f"fault tolerance: the live group's state is laid out unlike this one's: {differ}"
            )
        with torch.no_grad():
            for name, t in here.items():
                t.copy_(received[name])
        for optimizer, groups in zip(self.optimizers, state["param_groups"], strict=True):
            for group, saved in zip(optimizer.param_groups, groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        for key, other in self.others.items():
            other.load_state_dict(state[key])
        return sum(t.numel() * t.element_size() for t in received.values())

    def _make_optimizer_state(self, received: Mapping[str, torch.Tensor]) -> None:
        """A group that has not stepped yet has no optimizer state (torch creates it at the first step):
        make the entries the live group has, laid out as this rank's parameter is, for the copy to fill."""
        for i, (params, optimizer) in enumerate(zip(self.params, self.optimizers, strict=True)):
            for name, p in params:
                prefix = f"optimizer.{i}.{name}."
                keys = [k[len(prefix) :] for k in received if k.startswith(prefix)]
                state = optimizer.state[p]
                for key in keys:
                    if key in state:
                        continue
                    value = torch.zeros_like(received[prefix + key], device=local_shard(p).device)
                    if isinstance(p, DTensor) and value.shape == local_shard(p).shape:
                        value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
                    state[key] = value

    def digest(self) -> str:
        """A hash of this rank's weights and optimizer state, bit for bit: equal on two groups' rank r
        exactly when they hold the same state."""
        h = hashlib.sha256()
        for name, t in self._tensors():
            h.update(name.encode())
            h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

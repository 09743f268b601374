"""Low-rank adapters (LoRA): freeze a model and give chosen linear layers a trainable `B @ A` beside them.

Each adapted linear keeps its own parameters and names (`wq.weight` stays `wq.weight`, so checkpoints
and weight mappings of the base are unchanged) and gains two children, `lora_A` (rank x in) and
`lora_B` (out x rank), with a forward hook adding `scale * B(A(dropout(x)))` to its output, where
`scale = alpha / rank`. The layer itself may be any `nn.Linear` (a float8 one included), which is why
the quantisation converters run first. Mixture-of-experts routed experts are not linear layers: they
stay frozen with no adapter.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan_parallel.errors import ParallelConfigError
from titan_parallel.expert_parallel import moe_layers_of
from titan_parallel.parameter_names import plain_name
from titan_parallel.protocols import HasLinearsNotAdapted

logger = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"
LORA_A, LORA_B = "lora_A", "lora_B"


@dataclass(frozen=True)
class LoRA:
    """LoRA settings: `targets` are the last name segments of the linears to adapt (`wq`, `w2`) or
    `all-linear`; `trainable` names modules (as `named_modules` spells them) that train in full
    beside the adapters, e.g. the embedding and output head."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("wq", "wv")
    trainable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ParallelConfigError(f"lora: rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ParallelConfigError(f"lora: alpha must be above 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ParallelConfigError(f"lora: dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ParallelConfigError(
                "lora: targets is empty; name the linear layers to adapt, or all-linear"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def convert(self, model: nn.Module) -> nn.Module:
        """Freeze `model` and attach adapters to the target linears, in place (see `apply_lora`), without
        checking that every target exists: a pipeline stage may hold only some of them."""
        return _attach(model, self)


def target_linears(model: nn.Module, targets: Iterable[str]) -> dict[str, nn.Linear]:
    """The linear layers of `model` that `targets` select, by fully-qualified name. `all-linear` selects
    every one but those the model names in `linears_not_adapted()` (`HasLinearsNotAdapted`)."""
    targets = tuple(targets)
    not_all_linear = model.linears_not_adapted() if isinstance(model, HasLinearsNotAdapted) else ()
    chosen = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] in (LORA_A, LORA_B):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets or (ALL_LINEAR in targets and leaf not in not_all_linear):
            chosen[name] = module
    return chosen


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name segments of the linear layers of `model` (what `targets` may name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n})


def check_targets(model: nn.Module, targets: Iterable[str]) -> None:
    """Refuse a target that names no linear layer of `model`, listing those that exist."""
    names = linear_names(model)
    unknown = [t for t in targets if t != ALL_LINEAR and t not in names]
    if unknown:
        raise ParallelConfigError(
            f"lora: target_modules {unknown} match no linear layer of {type(model).__name__}; its linear layers "
            f"are {names} (or use all-linear)"
        )


def _add_adapter(module: nn.Linear, hook: _AdapterHook) -> None:
    """Give `module` its lora_A and lora_B (on the device and dtype of its weight) and the forward hook.

    A layer split by tensor parallelism (its weight a DTensor) gets adapters split to match, so that the
    adapter's output is laid out like the layer's own before its output is redistributed: a colwise layer
    (weight Shard(0): output columns split) gets `A` replicated and `B` Shard(0); a rowwise one (weight
    Shard(1): input columns split, output a partial sum) gets `A` Shard(1) and `B` replicated. The hook
    runs before the layer's tensor-parallel output hook (it is put first)."""
    weight = module.weight
    factory = {"device": weight.device, "dtype": weight.dtype}
    module.lora_A = nn.Linear(module.in_features, hook.rank, bias=False, **factory)
    module.lora_B = nn.Linear(hook.rank, module.out_features, bias=False, **factory)
    module.lora_dropout = nn.Dropout(hook.dropout) if hook.dropout else nn.Identity()
    if isinstance(weight, DTensor):
        a, b = _adapter_placements(weight)
        for child, placements in ((module.lora_A, a), (module.lora_B, b)):
            child.weight = nn.Parameter(distribute_tensor(child.weight.data, weight.device_mesh, placements))
    module.register_forward_hook(hook, prepend=True)


def _adapter_placements(weight: DTensor) -> tuple[list, list]:
    """The placements of `lora_A` and `lora_B` beside a tensor-parallel weight (see `_add_adapter`)."""
    if weight.device_mesh.ndim != 1:
        raise ParallelConfigError(
            f"lora: an adapted layer's weight is split over a {weight.device_mesh.ndim}-d mesh before LoRA; "
            "adapters follow tensor parallelism alone"
        )
    placement = weight.placements[0]
    if placement == Shard(0):
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):
        return [Shard(1)], [Replicate()]
    if placement == Replicate():
        return [Replicate()], [Replicate()]
    raise ParallelConfigError(f"lora: cannot place adapters beside a weight split as {weight.placements}")


class _AdapterHook:
    """`output + scale * B(A(dropout(x)))`, as a forward hook (a class: hooks must survive deepcopy)."""

    def __init__(self, rank: int, scale: float, dropout: float):
        self.rank, self.scale, self.dropout = rank, scale, dropout
        self.off = False  # see `adapters_off`

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.off:
            return output
        x = args[0]
        return output + self.scale * module.lora_B(module.lora_A(module.lora_dropout(x)))


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block, `model`'s adapted layers compute their frozen base alone (the adapters are
    skipped, not zeroed): preference tuning's reference model is the base, with no second copy."""
    hooks = {
        id(hook): hook
        for module in model.modules()
        for hook in module._forward_hooks.values()
        if isinstance(hook, _AdapterHook)
    }
    for hook in hooks.values():
        hook.off = True
    try:
        yield
    finally:
        for hook in hooks.values():
            hook.off = False


def apply_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    """Freeze every parameter of `model`, then attach trainable adapters to the linears `lora.targets`
    select and unfreeze the modules named in `lora.trainable`. Works on a meta-device model; call
    `init_lora` once it is materialised."""
    check_targets(model, lora.targets)
    return _attach(model, lora)


def _attach(model: nn.Module, lora: LoRA) -> nn.Module:
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = target_linears(model, lora.targets)
    hook = _AdapterHook(lora.rank, lora.scale, lora.dropout)
    for module in chosen.values():
        _add_adapter(module, hook)
    modules = dict(model.named_modules())
    for name in lora.trainable:
        if name in modules:  # a pipeline stage may not hold it
            modules[name].requires_grad_(True)
    experts = moe_layers_of(model)  # their routed experts are no linear layers: no adapters there
    logger.info(
        "lora: rank %d, alpha %g (scale %g), dropout %g: %d linear layers adapted (%s)%s%s",
        lora.rank,
        lora.alpha,
        lora.scale,
        lora.dropout,
        len(chosen),
        ", ".join(sorted({n.rsplit(".", 1)[-1] for n in chosen})),
        f"; trained in full: {', '.join(lora.trainable)}" if lora.trainable else "",
        f"; {len(experts)} routed-expert groups stay frozen without adapters" if experts else "",
    )
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """The fully-qualified names of the adapted linears of `model`."""
    return [n for n, m in model.named_modules() if isinstance(getattr(m, LORA_A, None), nn.Linear)]


def initial_lora_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of the adapter parameter `name` (full, float32 on CPU): `lora_A` Kaiming-uniform
    (a = sqrt(5), as nn.Linear and PEFT), `lora_B` zeros. It depends only on the name, shape and seed,
    so every layout and every Hugging Face import starts from the same adapters."""
    if f".{LORA_B}." in f".{name}":
        return torch.zeros(shape)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...lora_A.weight` or `...lora_B.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in (LORA_A, LORA_B)


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """Fill the adapters of a materialised model with `initial_lora_weight` (each rank its shard)."""
    for name, param in model.named_parameters():
        if not is_adapter_parameter(name):
            continue
        full = initial_lora_weight(plain_name(name), tuple(param.shape), seed)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)

"""QLoRA's frozen base: the weights of the adapted linear layers stored in 4-bit NormalFloat (NF4).

An adapted layer's weight never trains, so it can be kept in torchao's `NF4Tensor`: 4 bits a value plus
one 8-bit scale per `block_size` values and one float32 scale per `scaler_block_size` of those (about
0.52 bytes a parameter with torchao's defaults). Its matmul dequantises to the original dtype on the fly;
the adapters stay in that dtype and train as in LoRA. Call it once the base holds its final values (after
the initial load): quantisation is lossy and one-way. Under FSDP 2 the base is quantised whole and FSDP shards
the NF4 tensor (`titan_parallel.nf4_fsdp`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_parallel.errors import ParallelConfigError
from titan_parallel.lora import adapter_names
from titan_parallel.nf4_fsdp import fsdp_params_by_weight, quantize_sharded_weight

logger = logging.getLogger(__name__)

NF4_BLOCK_SIZE = 64
TORCHAO_FLOOR = (0, 17)  # the first torchao whose NF4 this module was checked against


def nf4_quantizer():
    """torchao's `to_nf4` (imported late: torchao is heavy, only QLoRA runs need it). torchao 0.18+ exports
    it from `torchao.quantization`; the floor, 0.17, only from `torchao.dtypes.nf4tensor`."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def torchao_nf4_problem(version: str) -> str | None:
    """Why the installed torchao (`version`, e.g. "0.18.0") cannot give QLoRA its NF4 base, or None."""
    try:
        found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"qlora: cannot read the torchao version {version!r}; install torchao>=0.17"
    if found < TORCHAO_FLOOR:
        return f"qlora: torchao {version} is too old for NF4 (to_nf4); install torchao>=0.17"
    return None


def nf4_size_problem(name: str, numel: int, scaler_block_size: int) -> str | None:
    """Why a weight of `numel` values cannot be stored in NF4 blocks, or None: NF4 cuts it into blocks of
    64 values, and their scales into groups of `scaler_block_size`."""
    if numel % (NF4_BLOCK_SIZE * scaler_block_size):
        return (
            f"qlora: {name}.weight has {numel} values, not a multiple of {NF4_BLOCK_SIZE} x "
            f"lora.nf4_scaler_block_size ({scaler_block_size}); choose a smaller nf4_scaler_block_size"
        )
    return None


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or the data of a parameter) is torchao's NF4Tensor."""
    return type(tensor).__name__ == "NF4Tensor"


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor's values in its original dtype (what its matmuls compute with), an FSDP shard of one as a
    shard of those values; other tensors as they are."""
    if isinstance(tensor, DTensor) and is_nf4(tensor._local_tensor):
        return DTensor.from_local(
            tensor._local_tensor.get_original_weight(),
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def quantize_base_to_nf4(model: nn.Module, scaler_block_size: int = 256) -> int:
    """Replace the weight of every LoRA-adapted linear of `model` by its NF4 copy (frozen); return how many.

    A weight FSDP 2 shards is quantised whole and re-sharded by FSDP (`titan_parallel.nf4_fsdp`, a
    collective: every rank calls this); any other split (tensor parallelism) is refused, as is a weight
    whose size NF4's blocks do not divide, naming the layer."""
    to_nf4 = nf4_quantizer()

    def quantize(weight: torch.Tensor) -> torch.Tensor:
        return to_nf4(weight.detach(), NF4_BLOCK_SIZE, scaler_block_size)

    modules = dict(model.named_modules())
    adapted = {name: modules[name] for name in adapter_names(model)}
    sharded = fsdp_params_by_weight(model)
    for name, module in adapted.items():
        weight = module.weight
        problem = nf4_size_problem(name, weight.numel(), scaler_block_size)
        if problem:
            raise ParallelConfigError(problem)
        fsdp_param = sharded.get((id(module), "weight"))
        if fsdp_param is not None:
            quantize_sharded_weight(name, module, fsdp_param, quantize)
            continue
        if isinstance(weight, DTensor):
            raise ParallelConfigError(
                f"qlora: {name}.weight is split across ranks ({weight.placements}); an NF4 base needs whole weights "
                "or FSDP's shards (no tensor parallelism)"
            )
        module.weight = nn.Parameter(quantize(weight), requires_grad=False)
    logger.info("qlora: %d adapted linear layers hold their frozen weight in NF4", len(adapted))
    return len(adapted)


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds, counting the inner tensors of a tensor subclass (NF4's codes and scales)."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()

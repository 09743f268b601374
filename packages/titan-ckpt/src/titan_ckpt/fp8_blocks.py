"""FP8 block-quantised Hugging Face weights (DeepSeek-V3's published format), dequantised where read.

Such a checkpoint stores a linear weight as float8 e4m3 beside a float32 `<name>_scale_inv` holding
one factor per 128x128 block (weight = fp8 * scale_inv; edge blocks are partial), and says so in
config.json's `quantization_config`. A rank must not dequantise the whole model to keep its rows:
each weight becomes a `BlockDequantized`, which reads the mapped file only for the rows asked of it.
Anything else done to it (a permutation, a transpose) dequantises it whole, correct but not streamed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from titan_ckpt.errors import CheckpointError
from titan_ckpt.lazy_weights import LazyWeight, materialised

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class BlockQuantization:
    """How a checkpoint's weights are quantised: float8 with one scale per `block` (rows, columns)."""

    block: tuple[int, int] = DEFAULT_BLOCK


def quantization_from_config(config: dict, *, forced: bool, where: str) -> BlockQuantization | None:
    """The block quantisation a config.json declares (`quantization_config`), or the default blocks when
    `forced` (torchtitan's `initial_load_in_hf_quantized`); None for plain weights. Refuses another kind."""
    q = config.get("quantization_config")
    if q is None:
        return BlockQuantization() if forced else None
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    block = q.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(
            f"checkpoint: {where} declares quantization_config {q}; Titan dequantises only DeepSeek-V3's "
            "format (quant_method fp8, fmt e4m3, weight_block_size [rows, columns]); convert it to bf16 first"
        )
    return BlockQuantization((int(block[0]), int(block[1])))


def _row_scales(scale_inv: torch.Tensor, start: int, stop: int, block: tuple[int, int], cols: int):
    """The scale of every element of rows [start, stop), shape (stop - start, cols)."""
    rows = scale_inv[torch.arange(start, stop) // block[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, :cols]


class BlockDequantized(LazyWeight):
    """A float8 weight and its block scales, dequantised to float32 only where indexed.

    A `LazyWeight`: indexing with slices stays lazy; `torch.stack` of several gives a lazy stack (stacked
    experts); any other torch function or tensor method dequantises it whole.
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        self.weight, self.scale_inv, self.block = weight, scale_inv, block

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) dequantised."""
        w = self.weight[start:stop].to(torch.float32)
        return w * _row_scales(self.scale_inv, start, stop, self.block, w.shape[1])

    def full(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1):
            return self.full()[index]
        start, stop, _ = first.indices(self.shape[0])
        return self.rows(start, max(start, stop))[(slice(None), *index[1:])]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack and not kwargs.get("dim") and len(args) == 1:
            return LazyStack(list(args[0]))
        return super().__torch_function__(func, types, args, kwargs)


class LazyStack(LazyWeight):
    """`torch.stack` of tensor-likes along a new first dimension, each item read only where indexed."""

    def __init__(self, items: Sequence[Any]):
        self.items = list(items)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self.items), *self.items[0].shape])

    def full(self) -> torch.Tensor:
        return torch.stack([materialised(item) for item in self.items])

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1) or not self.items:
            return self.full()[index]
        start, stop, _ = first.indices(len(self.items))
        rest = index[1:] or (slice(None),)
        picked = [materialised(item[rest]) for item in self.items[start:stop]]
        if picked:
            return torch.stack(picked)
        return torch.empty((0, *self.items[0].shape), dtype=self.dtype)[(slice(None), *rest)]


def dequantize_lazily(
    tensors: dict[str, torch.Tensor], quantization: BlockQuantization, where: str
) -> dict[str, Any]:
    """`tensors` with each float8 weight and its `_scale_inv` replaced by one `BlockDequantized`."""
    out: dict[str, Any] = {}
    scales = {name[: -len(SCALE_SUFFIX)]: t for name, t in tensors.items() if name.endswith(SCALE_SUFFIX)}
    rows, cols = quantization.block
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in tensors:
                raise CheckpointError(f"checkpoint: {where} has {name} but no {name[: -len(SCALE_SUFFIX)]}")
            continue
        scale = scales.get(name)
        if scale is None:
            if tensor.dtype in _FP8_DTYPES:
                raise CheckpointError(
                    f"checkpoint: {where}: the float8 weight {name} has no {name}{SCALE_SUFFIX}"
                )
            out[name] = tensor
            continue
        expected = (-(-tensor.shape[0] // rows), -(-tensor.shape[1] // cols)) if tensor.ndim == 2 else None
        if expected is None or tuple(scale.shape) != expected:
            raise CheckpointError(
                f"checkpoint: {where}: {name}{SCALE_SUFFIX} has shape {list(scale.shape)}, but {name} "
                f"{list(tensor.shape)} in {rows}x{cols} blocks needs {list(expected or ())}; "
                "the weight_block_size of quantization_config does not match the files"
            )
        out[name] = BlockDequantized(tensor, scale.to(torch.float32), quantization.block)
    return out

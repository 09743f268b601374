"""MXFP4 Hugging Face weights (gpt-oss's published format), dequantised where read, by Titan itself.

The published gpt-oss checkpoints store each expert projection `<name>` as two uint8 tensors:
`<name>_blocks` (..., groups, 16), two FP4 E2M1 values a byte (the low nibble first), and
`<name>_scales` (..., groups), one power-of-two exponent per group of 32 values with bias 127
(value = E2M1 * 2**(scale - 127)). config.json says `quantization_config.quant_method = "mxfp4"`.
Decoded, `<name>_blocks` (E, rows, cols/32, 16) is the (E, rows, cols) matrix that multiplies as
`x @ w.T`; transformers' bf16 layout stores its transpose, so the lazy weight is presented under the
bf16 name and layout, and the mapping's transpose back to rows-by-columns stays lazy. No special
PyTorch build or kernel is involved: a 16-entry table and a power of two.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_ckpt.errors import CheckpointError
from titan_ckpt.lazy_weights import LazyWeight

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
GROUP_SIZE = 32  # values per shared exponent (the MX block size)
SCALE_BIAS = 127  # the E8M0 exponent bias
# FP4 E2M1 by its 4-bit code: sign bit 3, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4_config(config: dict) -> bool:
    """Whether a config.json declares the MXFP4 quantisation of gpt-oss."""
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode MXFP4 `blocks` (..., G, 16) uint8 with `scales` (..., G) uint8 into (..., G * 32) of `dtype`.

    Exact in float32 and bfloat16: every E2M1 value times a power of two is representable in both."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(
            f"checkpoint: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP_SIZE // 2:
        raise CheckpointError(
            f"checkpoint: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up; "
            f"blocks must be (..., groups, {GROUP_SIZE // 2}) and scales (..., groups)"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).to(torch.int64)  # low nibble first
    values = table[codes].reshape(*blocks.shape[:-1], GROUP_SIZE)
    return (values * _powers_of_two(scales).unsqueeze(-1)).reshape(*scales.shape[:-1], -1).to(dtype)


def _powers_of_two(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (scale - 127) as float32, built from its bits so that it is exact (2 ** -127 is subnormal)."""
    bits = scales.to(torch.int32) << 23
    return torch.where(scales == 0, torch.tensor(1 << 22, dtype=torch.int32), bits).view(torch.float32)


class Mxfp4Dequantized(LazyWeight):
    """An MXFP4 weight (E, rows, cols) decoded to float32 only for the part indexed.

    Indexing with slices reads only those experts and rows (and the groups covering the columns);
    `transpose(1, 2)` gives a lazy view in the other layout; any other tensor operation decodes it
    whole, correct but not streamed. `transposed` presents it as (E, cols, rows), transformers' layout.
    """

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, *, transposed: bool = False):
        self.blocks, self.scales, self.transposed = blocks, scales, transposed

    @property
    def _stored_shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * GROUP_SIZE)

    @property
    def shape(self) -> torch.Size:
        e, rows, cols = self._stored_shape
        return torch.Size((e, cols, rows) if self.transposed else (e, rows, cols))

    @property
    def ndim(self) -> int:
        return 3

    def _stored(self, experts: slice, rows: slice, cols: slice) -> torch.Tensor:
        """The stored (E, rows, cols) layout's part, decoding only the groups that cover `cols`."""
        n_cols = self._stored_shape[2]
        c0, c1, _ = cols.indices(n_cols)
        c1 = max(c0, c1)
        g0, g1 = c0 // GROUP_SIZE, -(-c1 // GROUP_SIZE)
        decoded = dequantize_mxfp4(self.blocks[experts, rows, g0:g1], self.scales[experts, rows, g0:g1])
        return decoded[..., c0 - g0 * GROUP_SIZE : c1 - g0 * GROUP_SIZE]

    def full(self) -> torch.Tensor:
        whole = self._stored(slice(None), slice(None), slice(None))
        return whole.transpose(1, 2).contiguous() if self.transposed else whole

    def transpose(self, dim0: int, dim1: int) -> Mxfp4Dequantized:
        if sorted(d % 3 for d in (dim0, dim1)) != [1, 2]:
            return self.full().transpose(dim0, dim1)
        return Mxfp4Dequantized(self.blocks, self.scales, transposed=not self.transposed)

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3 or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            return self.full()[index]
        e, a, b = (*index, *(slice(None),) * (3 - len(index)))
        if self.transposed:  # (E, cols, rows) asked: read the stored rows b, columns a
            return self._stored(e, b, a).transpose(1, 2)
        return self._stored(e, a, b)


def holds_mxfp4(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's tensors include MXFP4 pairs (`*_blocks` with `*_scales`)."""
    return any(
        name.endswith(BLOCKS_SUFFIX) and name[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX in tensors
        for name in tensors
    )


def dequantize_mxfp4_lazily(tensors: dict[str, torch.Tensor], where: str) -> dict[str, Any]:
    """`tensors` with each `<name>_blocks`/`<name>_scales` pair replaced by one lazy `<name>` in
    transformers' bf16 layout (E, cols, rows), as a bf16 checkpoint names and lays it out."""
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX in tensors:
            continue
        if not name.endswith(BLOCKS_SUFFIX):
            out[name] = tensor
            continue
        base = name[: -len(BLOCKS_SUFFIX)]
        scales = tensors.get(base + SCALES_SUFFIX)
        if scales is None:
            raise CheckpointError(f"checkpoint: {where} has {name} but no {base}{SCALES_SUFFIX}")
        if (
            tensor.ndim != 4
            or tuple(tensor.shape[:-1]) != tuple(scales.shape)
            or tensor.shape[-1] != GROUP_SIZE // 2
        ):
            raise CheckpointError(
                f"checkpoint: {where}: {name} {list(tensor.shape)} and {base}{SCALES_SUFFIX} {list(scales.shape)} "
                f"are not an MXFP4 pair (experts, rows, groups, {GROUP_SIZE // 2}) and (experts, rows, groups)"
            )
        if tensor.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise CheckpointError(
                f"checkpoint: {where}: {name} and its scales must be uint8, got {tensor.dtype} and {scales.dtype}"
            )
        out[base] = Mxfp4Dequantized(tensor, scales, transposed=True)
    return out

"""Quantised Hugging Face folders on import: which format a folder holds (`FORMATS`), and its weights
dequantised lazily as `titan_ckpt.lazy_weights.LazyWeight`s (DeepSeek-V3's FP8 blocks, `titan_ckpt.fp8_blocks`;
gpt-oss's MXFP4, `titan_ckpt.mxfp4_blocks`), so that each rank decodes only the rows it keeps."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.errors import CheckpointError
from titan_ckpt.fp8_blocks import SCALE_SUFFIX, dequantize_lazily, quantization_from_config
from titan_ckpt.hf_files import StoredTensor
from titan_ckpt.lazy_weights import is_lazy
from titan_ckpt.mxfp4_blocks import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    dequantize_mxfp4_lazily,
    holds_mxfp4,
    is_mxfp4_config,
)

logger = logging.getLogger(__name__)

Dequantizer = Callable[[dict[str, torch.Tensor]], dict[str, Any]]


def _folder_config(folder: Path) -> dict:
    """The folder's config.json ({} where there is none)."""
    config_file = folder / "config.json"
    try:
        return json.loads(config_file.read_text()) if config_file.is_file() else {}
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {config_file} is not valid JSON ({err})") from err


@dataclass(frozen=True)
class QuantisedFormat:
    """A published quantised format of Hugging Face weights: `dequantizer(config, stored, forced, folder)`
    gives what turns the folder's tensors into `LazyWeight`s and the line that says so, or None when the
    folder is not in this format; `holds(stored)` tells files in this format, and `files` names them for the
    refusal of a folder whose config.json has no quantization_config."""

    name: str
    dequantizer: Callable[[dict, Mapping[str, StoredTensor], bool, Path], tuple[Dequantizer, str] | None]
    holds: Callable[[Mapping[str, StoredTensor]], bool]
    files: str


def _mxfp4(
    config: dict, stored: Mapping[str, StoredTensor], forced: bool, folder: Path
) -> tuple[Dequantizer, str] | None:
    if not (is_mxfp4_config(config) or (forced and holds_mxfp4(stored))):
        return None
    count = sum(n.endswith(BLOCKS_SUFFIX) for n in stored)
    said = f"{count} MXFP4 weights (E2M1 in groups of 32, exponent bias 127) of {folder}"
    said += " as each rank reads its experts"
    return (lambda tensors: dequantize_mxfp4_lazily(tensors, str(folder))), said


def _fp8_blocks(
    config: dict, stored: Mapping[str, StoredTensor], forced: bool, folder: Path
) -> tuple[Dequantizer, str] | None:
    quantization = quantization_from_config(config, forced=forced, where=str(folder))
    if quantization is None:
        return None
    rows, cols = quantization.block
    count = sum(n.endswith(SCALE_SUFFIX) for n in stored)
    said = f"{count} float8 weights ({rows}x{cols} blocks, weight = fp8 * scale_inv) of {folder}"
    said += " as each rank reads its rows"
    return (lambda tensors: dequantize_lazily(_with_their_weights(tensors), quantization, str(folder))), said


# The formats, asked in this order (MXFP4 first: a forced float8 read takes any folder); a new format is
# one more entry, with its `LazyWeight` subclass in a module of its own.
FORMATS: tuple[QuantisedFormat, ...] = (
    QuantisedFormat("mxfp4", _mxfp4, holds_mxfp4, f"MXFP4 *{BLOCKS_SUFFIX}/*{SCALES_SUFFIX} weights"),
    QuantisedFormat(
        "fp8_blocks",
        _fp8_blocks,
        lambda stored: any(name.endswith(SCALE_SUFFIX) for name in stored),
        f"float8 weights with *{SCALE_SUFFIX} block scales",
    ),
)


def folder_dequantizer(folder: Path, stored: Mapping[str, StoredTensor], forced: bool) -> Dequantizer | None:
    """What turns the folder's quantised weights into lazily dequantised ones (said once); None for plain
    weights. Quantised files without a quantization_config are refused unless `forced`."""
    config = _folder_config(folder)
    for fmt in FORMATS:
        found = fmt.dequantizer(config, stored, forced, folder)
        if found is not None:
            logger.info("checkpoint: dequantising %s", found[1])
            return found[0]
    for fmt in FORMATS:
        if fmt.holds(stored):
            raise CheckpointError(
                f"checkpoint: {folder} holds {fmt.files} but its config.json has no quantization_config; set "
                "checkpoint.initial_load_in_hf_quantized = true to dequantise them"
            )
    return None


def stand_ins(
    stored: Mapping[str, StoredTensor], names: list[str], dequantize: Dequantizer | None
) -> dict[str, torch.Tensor]:
    """Meta tensors shaped as the named tensors read, dequantised (names and shapes) where the folder is
    quantised: the weight mapping permutes and stacks them for free."""
    meta = {n: torch.empty(stored[n].shape, dtype=stored[n].dtype, device="meta") for n in names}
    if dequantize is None:
        return meta
    return {
        n: t if isinstance(t, torch.Tensor) else torch.empty(t.shape, dtype=t.dtype, device="meta")
        for n, t in dequantize(meta).items()
    }


def is_dequantized_lazily(value: Any) -> bool:
    """Whether `value` is a weight decoded only where indexed."""
    return is_lazy(value)


def _with_their_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` without the block scales of weights that are stand-ins in this pass (read with another block)."""
    return {
        n: t
        for n, t in tensors.items()
        if not n.endswith(SCALE_SUFFIX) or n.removesuffix(SCALE_SUFFIX) in tensors
    }

"""Model weights to and from Hugging Face's sharded safetensors layout, through a caller's name mapping.

titan-ckpt knows nothing of any model: the caller passes an adapter (`HFStateDictAdapter`) that
renames and re-lays out full, unsharded tensors. Export is `titan_ckpt.hf_export` (every rank
writes its share). Import has every rank read the files and keep the slice its DTensors own, so any layout
(FSDP, TP, one rank) loads the same files; float8 block-quantised files (`titan_ckpt.fp8_blocks`) and
MXFP4 files (`titan_ckpt.mxfp4_blocks`) are dequantised on the way, each rank only for its rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_ckpt.errors import CheckpointError
from titan_ckpt.fp8_blocks import SCALE_SUFFIX, dequantize_lazily, quantization_from_config
from titan_ckpt.fp8_blocks import is_lazy as is_lazy_fp8
from titan_ckpt.mxfp4_blocks import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    Mxfp4Dequantized,
    dequantize_mxfp4_lazily,
    holds_mxfp4,
    is_mxfp4_config,
)
from titan_ckpt.step_folders import HF_INDEX

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's own default shard size ("5GB")


# Titan's own tensors in a Hugging Face folder: state the format has no place for, kept under this
# prefix so that Titan's re-import is exact (transformers names them as unused and ignores them).
TITAN_ONLY_PREFIX = "titan."


@runtime_checkable
class HFStateDictAdapter(Protocol):
    """Maps a model's full state dict to Hugging Face names and layout and back.

    Optional attributes: `hf_unheld_state`, suffixes of the model's names for state the Hugging Face
    format cannot hold (its neutral value is zero); `hf_keep_dtype`, suffixes of Hugging Face names
    transformers keeps in their own precision whatever the export dtype."""

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def hf_config(self) -> dict: ...


def unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no two sharing memory, as safetensors requires."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out


def read_hf_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face safetensors checkpoint (index + shards, or lone `*.safetensors`)."""
    index_file = folder / HF_INDEX
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(
                f"checkpoint: {index_file} is not a valid safetensors index ({err})"
            ) from err
        files = sorted({folder / name for name in weight_map.values()})
    else:
        weight_map = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"checkpoint: {folder} holds no {HF_INDEX} and no *.safetensors file; point the initial load "
                "at a Hugging Face model folder, or unset initial_load_in_hf for a DCP checkpoint"
            )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            key = next(k for k, v in weight_map.items() if folder / v == file)
            raise CheckpointError(f"checkpoint: {file} is missing (the index lists '{key}' in it)")
        try:
            tensors.update(load_file(str(file)))
        except Exception as err:
            raise CheckpointError(
                f"checkpoint: cannot read {file} ({err}); the file is truncated or not safetensors"
            ) from err
    for key, name in weight_map.items():
        if key not in tensors:
            raise CheckpointError(
                f"checkpoint: {folder / name} has no tensor '{key}' although {index_file} lists it"
            )
    return tensors


def _folder_config(folder: Path) -> dict:
    """The folder's config.json ({} where there is none)."""
    config_file = folder / "config.json"
    try:
        return json.loads(config_file.read_text()) if config_file.is_file() else {}
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {config_file} is not valid JSON ({err})") from err


def _dequantized(folder: Path, hf: dict[str, torch.Tensor], forced: bool) -> dict[str, Any]:
    """`hf` with its quantised weights (gpt-oss MXFP4 or DeepSeek FP8 blocks) lazily dequantised."""
    config = _folder_config(folder)
    if is_mxfp4_config(config) or (forced and holds_mxfp4(hf)):
        return dequantize_mxfp4_lazily(hf, str(folder))
    quantization = quantization_from_config(config, forced=forced, where=str(folder))
    if quantization is not None:
        return dequantize_lazily(hf, quantization, str(folder))
    if any(name.endswith(SCALE_SUFFIX) for name in hf):
        raise CheckpointError(
            f"checkpoint: {folder} holds float8 weights with *{SCALE_SUFFIX} block scales but its config.json has "
            "no quantization_config; set checkpoint.initial_load_in_hf_quantized = true to dequantise them"
        )
    if holds_mxfp4(hf):
        raise CheckpointError(
            f"checkpoint: {folder} holds MXFP4 *{BLOCKS_SUFFIX}/*{SCALES_SUFFIX} weights but its config.json has no "
            "quantization_config; set checkpoint.initial_load_in_hf_quantized = true to dequantise them"
        )
    return hf


def _local_part(source: Any, tensor: DTensor) -> torch.Tensor | None:
    """The rows of a lazily dequantised `source` that this rank's shard of `tensor` holds, read alone;
    None where the placements are not plain shards or replicas."""
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return source[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def load_hf_weights(
    folder: Path, adapter: HFStateDictAdapter, target: Mapping[str, Any], *, quantized: bool = False
) -> None:
    """Copy the weights of a Hugging Face folder into `target` (plain tensors or DTensors), in place.

    Float8 block-quantised and MXFP4 weights (config.json's `quantization_config`, or any folder when
    `quantized`) are dequantised, each rank only for the rows it keeps."""
    hf = read_hf_folder(folder)
    titan_only = {
        k.removeprefix(TITAN_ONLY_PREFIX): hf.pop(k) for k in list(hf) if k.startswith(TITAN_ONLY_PREFIX)
    }
    hf = _dequantized(folder, hf, quantized)
    try:
        ours = adapter.from_hf(hf) | titan_only
    except Exception as err:
        raise CheckpointError(f"checkpoint: the weight mapping cannot convert {folder}: {err}") from err
    where = folder / HF_INDEX if (folder / HF_INDEX).is_file() else folder
    for key, tensor in target.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if key not in ours:
            raise CheckpointError(
                f"checkpoint: {where} has no weight for '{key}' (after the Hugging Face mapping)"
            )
        source = ours[key]
        if tuple(source.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint: '{key}' from {where} has shape {list(source.shape)} but the model expects "
                f"{list(tensor.shape)}; the files come from a different model shape"
            )
        with torch.no_grad():
            lazy = is_lazy_fp8(source) or isinstance(source, Mxfp4Dequantized)
            local = _local_part(source, tensor) if lazy and isinstance(tensor, DTensor) else None
            if local is not None:
                tensor.to_local().copy_(local.to(device=tensor.device, dtype=tensor.dtype))
                continue
            source = source.to(device=tensor.device, dtype=tensor.dtype)
            if isinstance(tensor, DTensor):
                # src_data_rank=None: every rank holds the full tensor and keeps its slice, no communication.
                local = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(source)
    logger.info("loaded %d tensors from Hugging Face files in %s", len(target), folder)

"""Import of a Hugging Face folder into a model's (sharded or not) state, one block at a time.

Every rank reads the files and keeps the slice its DTensors own, so any layout loads the same folder.
A rank must never hold the whole model: a published 70B or 671B checkpoint is larger than a node's
memory. The adapter's `from_hf` maps a whole state dict (it checks the key set and stacks experts), so it
is called once per transformer block: that block's tensors are read from the files, every other large
tensor is a meta stand-in of the right shape (free to permute or stack), and only the real results are
copied. Vectors (norms, biases) are read once and stay real, so checks on their values still see
them. A rank's memory grows by about one block, not by the model.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_ckpt.errors import CheckpointError
from titan_ckpt.fp8_blocks import (
    SCALE_SUFFIX,
    BlockQuantization,
    dequantize_lazily,
    is_lazy,
    quantization_from_config,
)
from titan_ckpt.hf_safetensors import TITAN_ONLY_PREFIX, HFStateDictAdapter
from titan_ckpt.step_folders import HF_INDEX

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a folder's files and what it is, read from the safetensors header alone."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def small(self) -> bool:
        """A vector (a norm, a bias): read once and kept real through every block's pass, so that checks
        on its values still see it. Matrices, however small, are read with their block: a bench model's
        experts can be tiny matrices that together make most of the model."""
        return len(self.shape) <= 1


def _header(file: Path) -> dict[str, Any]:
    """The safetensors header of `file`, checked against the file's size (a truncated copy fails here)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if file.stat().st_size < 8 + size + end:
            raise ValueError(f"{file.stat().st_size} bytes where the header needs {8 + size + end}")
        for name, v in header.items():
            if v["dtype"] not in _DTYPES:
                raise ValueError(f"tensor {name} has dtype {v['dtype']}, which Titan does not read")
        return header
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise CheckpointError(
            f"checkpoint: cannot read {file} ({err}); the file is truncated or not safetensors"
        ) from err


def index_hf_folder(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face safetensors checkpoint (index + shards, or lone `*.safetensors`),
    found from the headers without reading any data."""
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
    stored: dict[str, StoredTensor] = {}
    for file in files:
        if not file.is_file():
            key = next(k for k, v in weight_map.items() if folder / v == file)
            raise CheckpointError(f"checkpoint: {file} is missing (the index lists '{key}' in it)")
        for name, v in _header(file).items():
            stored[name] = StoredTensor(file, tuple(v["shape"]), _DTYPES[v["dtype"]])
    for key, name in weight_map.items():
        if key not in stored:
            raise CheckpointError(
                f"checkpoint: {folder / name} has no tensor '{key}' although {index_file} lists it"
            )
    return stored


def _read(stored: Mapping[str, StoredTensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors, read from their files (each file opened once, closed after)."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(stored[name].file, []).append(name)
    out = {}
    for file, in_file in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in in_file}
    return out


def _block_of(name: str) -> int:
    """The transformer block a Hugging Face name belongs to; -1 for the rest (embeddings, final norm)."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else -1


def folder_quantization(folder: Path, forced: bool) -> BlockQuantization | None:
    """The block quantisation of the folder's weights (from its config.json), None for plain weights."""
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {config_file} is not valid JSON ({err})") from err
    return quantization_from_config(config, forced=forced, where=str(folder))


def _stand_in(entry: StoredTensor, quantization: BlockQuantization | None) -> torch.Tensor:
    """A meta tensor shaped as `entry` reads (a float8 weight dequantises to float32)."""
    dtype = torch.float32 if quantization is not None and entry.dtype.itemsize == 1 else entry.dtype
    return torch.empty(entry.shape, dtype=dtype, device="meta")


def _is_stand_in(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _local_part(source: Any, tensor: DTensor) -> torch.Tensor | None:
    """The rows of a lazily dequantised `source` that this rank's shard of `tensor` holds, read alone;
    None where the placements are not plain shards or replicas."""
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return source[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def _copy_into(tensor: torch.Tensor, source: Any) -> None:
    with torch.no_grad():
        local = _local_part(source, tensor) if is_lazy(source) and isinstance(tensor, DTensor) else None
        if local is not None:
            tensor.to_local().copy_(local.to(device=tensor.device, dtype=tensor.dtype))
            return
        source = source.to(device=tensor.device, dtype=tensor.dtype)
        if isinstance(tensor, DTensor):
            # src_data_rank=None: every rank holds the full tensor and keeps its slice, no communication.
            local = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(local.to_local())
        else:
            tensor.copy_(source)


class _SaidOnce(logging.Filter):
    """Drops a log line already emitted: the adapter runs once per block and says its notes each time."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextmanager
def _each_line_once() -> Iterator[None]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {h: _SaidOnce() for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    for handler, said in handlers.items():
        handler.addFilter(said)  # one per handler: each must see every line once
    try:
        yield
    finally:
        for handler, said in handlers.items():
            handler.removeFilter(said)


def load_hf_weights(
    folder: Path, adapter: HFStateDictAdapter, target: Mapping[str, Any], *, quantized: bool = False
) -> None:
    """Copy the weights of a Hugging Face folder into `target` (plain tensors or DTensors), in place, one
    transformer block at a time.

    Float8 block-quantised weights (config.json's `quantization_config`, or any folder when `quantized`)
    are dequantised, each rank only for the rows it keeps."""
    stored = index_hf_folder(folder)
    quantization = folder_quantization(folder, quantized)
    if quantization is None and any(name.endswith(SCALE_SUFFIX) for name in stored):
        raise CheckpointError(
            f"checkpoint: {folder} holds float8 weights with *{SCALE_SUFFIX} block scales but its config.json has "
            "no quantization_config; set checkpoint.initial_load_in_hf_quantized = true to dequantise them"
        )
    small = {n for n, e in stored.items() if e.small or n.startswith(TITAN_ONLY_PREFIX)}
    kept = _read(stored, small)
    titan_only = {
        k.removeprefix(TITAN_ONLY_PREFIX): kept.pop(k) for k in list(kept) if k.startswith(TITAN_ONLY_PREFIX)
    }
    mapped = [n for n in stored if not n.startswith(TITAN_ONLY_PREFIX)]
    blocks = sorted({_block_of(n) for n in mapped})
    where = folder / HF_INDEX if (folder / HF_INDEX).is_file() else folder
    wanted = {k: t for k, t in target.items() if isinstance(t, torch.Tensor)}
    if quantization is not None:
        logger.info(
            "checkpoint: dequantising %d float8 weights (%dx%d blocks, weight = fp8 * scale_inv) of %s as each "
            "rank reads its rows",
            sum(n.endswith(SCALE_SUFFIX) for n in stored),
            *quantization.block,
            folder,
        )
    loaded: set[str] = set()
    with _each_line_once():
        for i, block in enumerate(blocks):
            names = {n for n in mapped if _block_of(n) == block}
            real = kept | _read(stored, names - small)
            hf = {n: _stand_in(stored[n], quantization) for n in mapped if n not in real}
            if quantization is not None:
                real = dequantize_lazily(_with_their_weights(real), quantization, str(folder))
                hf = {n: t for n, t in hf.items() if not n.endswith(SCALE_SUFFIX)}
            try:
                ours = adapter.from_hf(hf | real) | titan_only
            except Exception as err:
                raise CheckpointError(
                    f"checkpoint: the weight mapping cannot convert {folder}: {err}"
                ) from err
            if i == 0:
                _check_against(ours, wanted, where)
            for key, tensor in wanted.items():
                source = ours[key]
                if key not in loaded and not _is_stand_in(source):
                    _copy_into(tensor, source)
                    loaded.add(key)
            del real, hf, ours
    logger.info("loaded %d tensors from Hugging Face files in %s", len(target), folder)


def _with_their_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` without the block scales of weights that are stand-ins in this pass."""
    return {
        n: t
        for n, t in tensors.items()
        if not n.endswith(SCALE_SUFFIX) or n.removesuffix(SCALE_SUFFIX) in tensors
    }


def _check_against(ours: Mapping[str, Any], wanted: Mapping[str, torch.Tensor], where: Path) -> None:
    """Every tensor the model wants, of its shape, before any is copied."""
    for key, tensor in wanted.items():
        if key not in ours:
            raise CheckpointError(
                f"checkpoint: {where} has no weight for '{key}' (after the Hugging Face mapping)"
            )
        if tuple(ours[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint: '{key}' from {where} has shape {list(ours[key].shape)} but the model expects "
                f"{list(tensor.shape)}; the files come from a different model shape"
            )

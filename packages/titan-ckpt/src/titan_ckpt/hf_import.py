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

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_ckpt.errors import CheckpointError
from titan_ckpt.hf_files import index_hf_folder, read_tensors
from titan_ckpt.hf_quantized import folder_dequantizer, is_dequantized_lazily, stand_ins
from titan_ckpt.hf_safetensors import TITAN_ONLY_PREFIX, HFStateDictAdapter
from titan_ckpt.step_folders import HF_INDEX

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _block_of(name: str) -> int:
    """The transformer block a Hugging Face name belongs to; -1 for the rest (embeddings, final norm)."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else -1


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
        local = (
            _local_part(source, tensor)
            if is_dequantized_lazily(source) and isinstance(tensor, DTensor)
            else None
        )
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

    Float8 block-quantised and MXFP4 weights (config.json's `quantization_config`, or any folder when
    `quantized`) are dequantised, each rank only for the rows it keeps."""
    stored = index_hf_folder(folder)
    dequantize = folder_dequantizer(folder, stored, quantized)
    small = {n for n, e in stored.items() if e.small or n.startswith(TITAN_ONLY_PREFIX)}
    kept = read_tensors(stored, small)
    titan_only = {
        k.removeprefix(TITAN_ONLY_PREFIX): kept.pop(k) for k in list(kept) if k.startswith(TITAN_ONLY_PREFIX)
    }
    mapped = [n for n in stored if not n.startswith(TITAN_ONLY_PREFIX)]
    blocks = sorted({_block_of(n) for n in mapped})
    where = folder / HF_INDEX if (folder / HF_INDEX).is_file() else folder
    wanted = {k: t for k, t in target.items() if isinstance(t, torch.Tensor)}
    loaded: set[str] = set()
    with _each_line_once():
        for i, block in enumerate(blocks):
            names = {n for n in mapped if _block_of(n) == block}
            real = kept | read_tensors(stored, names - small)
            hf = stand_ins(stored, [n for n in mapped if n not in real], dequantize)
            if dequantize is not None:
                real = dequantize(real)
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

"""A Hugging Face folder's safetensors files, read from their headers first and their data only when asked.

An import must know every tensor's name, shape and dtype before it reads any (to check the mapping and to
stand in for the tensors it has not read yet), and must read a block's tensors without the rest: the
header says all of that, and `safe_open` reads one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from titan_ckpt.errors import CheckpointError
from titan_ckpt.hf_safetensors import TITAN_WEIGHT_MAP
from titan_ckpt.step_folders import HF_INDEX

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
            index = json.loads(index_file.read_text())
            # Titan's own tensors (titan_ckpt.hf_export) sit in a file the HF weight_map never names.
            weight_map: dict[str, str] = {**index["weight_map"], **index.get(TITAN_WEIGHT_MAP, {})}
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


def read_tensors(stored: Mapping[str, StoredTensor], names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors, read from their files (each file opened once, closed after)."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(stored[name].file, []).append(name)
    out = {}
    for file, in_file in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in in_file}
    return out

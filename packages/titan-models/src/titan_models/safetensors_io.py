"""Sharded safetensors folders in Hugging Face's layout, read and written with `safetensors`.

A folder holds `model-0000K-of-0000N.safetensors` files and `model.safetensors.index.json`, whose
`weight_map` names the file of every tensor; `from_pretrained` loads such a folder directly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from titan_models.errors import WeightMappingError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, a new shard whenever the next one would overflow the current."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += _nbytes(tensor)
    return shards


def save_safetensors_sharded(
    state_dict: dict[str, torch.Tensor],
    folder: str | Path,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    config: dict | None = None,
) -> list[Path]:
    """Write `state_dict` as safetensors shards plus the index; `config` becomes `config.json`.

    Tensors are copied off their device and made contiguous; tensors that share memory (a tied
    matrix under two names) are written once each, as independent copies, since safetensors
    refuses shared storage.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        key = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if key in seen else t
        seen.add(key)
    shards = _shards(tensors, max_shard_bytes)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        paths.append(path)
        weight_map |= {name: path.name for name in shard}
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    logger.info("wrote %d tensors in %d safetensors shards to %s", len(tensors), len(shards), folder)
    return paths


def load_safetensors_sharded(
    folder: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read every tensor of a folder written by `save_safetensors_sharded` or by Hugging Face."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise WeightMappingError(
            f"model: {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}; point at a Hugging Face model folder"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise WeightMappingError(f"model: {INDEX_FILE} in {folder} names {name}, which is missing")
        state_dict |= load_file(folder / name, device=str(device))
    missing = sorted(set(weight_map) - set(state_dict))
    if missing:
        raise WeightMappingError(f"model: tensors listed in {index_path} are in no shard: {missing[:5]}")
    return state_dict

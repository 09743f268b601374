"""Checks a DCP checkpoint against the state about to be loaded, before a single byte is read.

DCP's own errors on a bad checkpoint are raised deep inside a collective and rarely say which file
is at fault. Checking the `.metadata` index first lets a truncated file, a missing key or a shape
mismatch fail on every rank with a message naming the file and the key, before training starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ckpt.errors import CheckpointError
from titan_ckpt.step_folders import DCP_METADATA


def flatten_state_dict(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested state dict under the dotted names DCP stores them by.

    Mirrors DCP's rule: mappings are always walked; a list is walked by index only when it holds
    a tensor or a mapping, otherwise it is one leaf (saved as bytes).
    """
    flat: dict[str, Any] = {}
    for key, value in state.items():
        _flatten_into(flat, f"{prefix}{key}", value)
    return flat


def _holds_structure(value: list) -> bool:
    return any(
        isinstance(v, (torch.Tensor, Mapping)) or (isinstance(v, list) and _holds_structure(v)) for v in value
    )


def _flatten_into(flat: dict[str, Any], name: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten_into(flat, f"{name}.{key}", inner)
    elif isinstance(value, list) and _holds_structure(value):
        for index, inner in enumerate(value):
            _flatten_into(flat, f"{name}.{index}", inner)
    else:
        flat[name] = value


def read_metadata(path: Path) -> Metadata:
    """The `.metadata` index of the DCP checkpoint in `path`, or a CheckpointError naming the file."""
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(
            f"checkpoint: cannot read {path / DCP_METADATA} ({type(err).__name__}: {err}); the checkpoint is "
            f"corrupt: delete {path} to resume from an older one"
        ) from err


def saved_keys(metadata: Metadata) -> set[str]:
    return set(metadata.state_dict_metadata)


def _other_format(path: Path, metadata: Metadata, flat_state: Mapping[str, Any], top: str) -> str | None:
    """A message when the checkpoint holds state `top`, but under none of the keys this run's `top` has."""
    prefix = f"{top}."
    saved = sorted(k[len(prefix) :] for k in metadata.state_dict_metadata if k.startswith(prefix))
    wanted = sorted(k[len(prefix) :] for k in flat_state if k.startswith(prefix))
    shape = lambda key: re.sub(r"\d+", "N", key)  # noqa: E731  (stream_5 is stream_0's format)
    if not saved or {shape(k) for k in saved} & {shape(k) for k in wanted}:
        return None
    return (
        f"checkpoint: the '{top}' state in {path} has another format than this run's (saved keys "
        f"{', '.join(saved[:3])}{', ...' if len(saved) > 3 else ''}; this run reads {', '.join(wanted[:3])}"
        f"{', ...' if len(wanted) > 3 else ''}): it was written by another program or data pipeline "
        f"(such as torchtitan); add '{top}' to checkpoint.exclude_from_loading to start that state fresh"
    )


def find_problem(
    path: Path, metadata: Metadata, flat_state: Mapping[str, Any], state_names: Iterable[str] = ()
) -> str | None:
    """The first reason `flat_state` cannot be loaded from the checkpoint in `path`, or None.

    `state_names` are the non-model states: one saved in another format is named as such.
    """
    storage: dict[str, list[Any]] = {}
    for index, info in metadata.storage_data.items():
        storage.setdefault(index.fqn, []).append(info)
    file_sizes: dict[str, int | None] = {}
    state_names = set(state_names)
    for key, value in flat_state.items():
        saved = metadata.state_dict_metadata.get(key)
        if saved is None:
            top = key.split(".", 1)[0]
            other = _other_format(path, metadata, flat_state, top) if top in state_names else None
            if other:
                return other
            return (
                f"checkpoint: {path / DCP_METADATA} has no key '{key}' (saved from a different model, or "
                f"without that state); load it into a matching model, or add '{top}' to exclude_from_loading "
                "to start that state fresh"
            )
        infos = storage.get(key, [])
        where = path / infos[0].relative_path if infos else path / DCP_METADATA
        if isinstance(value, torch.Tensor):
            if not isinstance(saved, TensorStorageMetadata):
                return f"checkpoint: '{key}' in {where} is a saved object, but a tensor is expected"
            if tuple(saved.size) != tuple(value.shape):
                return (
                    f"checkpoint: '{key}' in {where} has shape {list(saved.size)} but the model expects "
                    f"{list(value.shape)}; the checkpoint comes from a different model shape (check the model "
                    "flavor and vocabulary size)"
                )
        elif isinstance(saved, TensorStorageMetadata):
            return f"checkpoint: '{key}' in {where} is a tensor, but a {type(value).__name__} is expected"
        for info in infos:
            problem = _check_file(path, info, key, file_sizes)
            if problem:
                return problem
    return None


def _check_file(path: Path, info: Any, key: str, file_sizes: dict[str, int | None]) -> str | None:
    name = info.relative_path
    if name not in file_sizes:
        file = path / name
        file_sizes[name] = file.stat().st_size if file.is_file() else None
    size = file_sizes[name]
    if size is None:
        return f"checkpoint: {path / name} is missing (it holds '{key}'); delete {path} to resume from an older one"
    end = info.offset + info.length
    if size < end:
        return (
            f"checkpoint: {path / name} is truncated: it has {size} bytes but '{key}' is stored at bytes "
            f"{info.offset}..{end}; delete {path} to resume from an older one"
        )
    return None

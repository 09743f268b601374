"""What export and import of Hugging Face's sharded safetensors layout share: the adapter protocol.

titan-ckpt knows nothing of any model: the caller passes an adapter (`HFStateDictAdapter`) that
renames and re-lays out full, unsharded tensors. Export is `titan_ckpt.hf_export` (every rank
writes its share); import is `titan_ckpt.hf_import` (every rank reads its slices, a block at a time).
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's own default shard size ("5GB")


# Titan's own tensors in a Hugging Face folder: state the format has no place for, kept under this
# prefix so that Titan's re-import is exact. They live in a file the index's weight_map never names
# (listed under TITAN_WEIGHT_MAP), so transformers and vLLM, which read the files weight_map names, never see them.
TITAN_ONLY_PREFIX = "titan."
TITAN_STATE_FILE = "titan-state.safetensors"
TITAN_WEIGHT_MAP = "titan_weight_map"


@runtime_checkable
class HFStateDictAdapter(Protocol):
    """Maps a model's full state dict to Hugging Face names and layout and back.

    An adapter may also answer the optional protocols below (`HasUnheldState`, `HasKeptDtypes`).
    """

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def hf_config(self) -> dict: ...


@runtime_checkable
class HasUnheldState(Protocol):
    """An adapter whose format has no place for some of the model's state (its neutral value is zero)."""

    hf_unheld_state: tuple[str, ...]  # suffixes of the model's state names


@runtime_checkable
class HasKeptDtypes(Protocol):
    """An adapter naming tensors transformers keeps in their own precision whatever the export dtype."""

    hf_keep_dtype: tuple[str, ...]  # suffixes of Hugging Face names


def unheld_state(adapter: object) -> tuple[str, ...]:
    """Suffixes of the model's state names `adapter`'s format cannot hold; () for an adapter that holds all."""
    return tuple(adapter.hf_unheld_state) if isinstance(adapter, HasUnheldState) else ()


def kept_dtypes(adapter: object) -> tuple[str, ...]:
    """Suffixes of Hugging Face names `adapter` keeps in their own precision; () for none."""
    return tuple(adapter.hf_keep_dtype) if isinstance(adapter, HasKeptDtypes) else ()


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

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
# prefix so that Titan's re-import is exact (transformers names them as unused and ignores them).
TITAN_ONLY_PREFIX = "titan."


@runtime_checkable
class HFStateDictAdapter(Protocol):
    """Maps a model's full state dict to Hugging Face names and layout and back.

    Optional attributes: `hf_unheld_state`, suffixes of the model's names for state the Hugging Face
    format cannot hold (its neutral value is zero); `hf_keep_dtype`, suffixes of Hugging Face names
    transformers keeps in their own precision whatever the export dtype.
    """

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

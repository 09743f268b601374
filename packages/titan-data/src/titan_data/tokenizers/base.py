"""The interface every tokenizer offers to datasets and the trainer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from titan_data.errors import DataError


class Tokenizer(ABC):
    """Text to token ids and back, with the ids of the document markers."""

    bos_id: int
    eos_id: int

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding must be at least this)."""

    @abstractmethod
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS and EOS."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of text a chat template rendered: special-token text there (role headers,
        end-of-turn markers) becomes the control tokens it names, as transformers tokenises it."""
        raise DataError(
            f"tokenizer: {type(self).__name__} cannot encode chat templates; use a tokenizer.json"
        )

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of control tokens (BOS, EOS and any others the tokenizer reserves): what readable text,
        such as an evaluation's answers, leaves out."""
        return frozenset({self.bos_id, self.eos_id})

    def encode_array(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """`encode` as a uint32 array: what packing and preprocessing consume. Tokenizers that can
        write ids straight into an array override this to skip making a Python int per token."""
        return np.array(self.encode(text, bos=bos, eos=eos), dtype=np.uint32)

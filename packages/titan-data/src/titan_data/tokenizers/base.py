"""The interface every tokenizer offers to datasets and the trainer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from titan_data.errors import DataError


class Tokenizer(ABC):
    """Text to token ids and back, with the ids of the document markers.

    `bos_id` is None where the tokenizer declares no BOS (Qwen's). `add_bos` says whether a document
    starts with BOS (`encode(text, bos=True)` puts it there only then), as the tokenizer's own files
    decide: always for Llama 2 and 3's `tokenizer.model`, by the config for a `tokenizer.json`.
    """

    bos_id: int | None
    eos_id: int
    add_bos: bool = True

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding must be at least this)."""

    @abstractmethod
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed as a document: BOS in front where the tokenizer adds
        one (`add_bos`), EOS after."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of text a chat template rendered: special-token text there (role headers,
        end-of-turn markers) becomes the control tokens it names, as transformers tokenises it."""
        return self.encode_chat_with_offsets(text)[0]

    def encode_chat_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_chat`, with each token's (start, end) character span in `text`: how spans the
        template marks in the text become spans of tokens."""
        raise DataError(
            f"tokenizer: {type(self).__name__} cannot encode chat templates; use a tokenizer.json"
        )

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of control tokens (BOS, EOS and any others the tokenizer reserves): what readable text,
        such as an evaluation's answers, leaves out."""
        return frozenset(i for i in (self.bos_id, self.eos_id) if i is not None)

    def encode_array(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """`encode` as a uint32 array: what packing and preprocessing consume. Tokenizers that can
        write ids straight into an array override this to skip making a Python int per token."""
        return np.array(self.encode(text, bos=bos, eos=eos), dtype=np.uint32)

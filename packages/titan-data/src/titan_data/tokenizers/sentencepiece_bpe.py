"""The Llama 2 tokenizer format: a sentencepiece `tokenizer.model` (BPE with byte fallback)."""

from __future__ import annotations

from pathlib import Path

import sentencepiece

from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """Llama 2 tokenizer: ids, BOS and EOS all come from the sentencepiece model file."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self._model = sentencepiece.SentencePieceProcessor()
        try:
            self._model.Load(str(path))
        except (OSError, RuntimeError) as err:
            raise DataError(
                f"tokenizer: {path} is neither a tiktoken (Llama 3) nor a sentencepiece (Llama 2) "
                f"tokenizer.model: {err}"
            ) from err
        self.bos_id, self.eos_id = self._model.bos_id(), self._model.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise DataError(
                f"tokenizer: the sentencepiece model {path} defines no BOS or EOS piece (bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}); train it with bos_id and eos_id set"
            )
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._model.GetPieceSize()

    @property
    def special_ids(self) -> frozenset[int]:
        model = self._model
        return frozenset(i for i in range(model.GetPieceSize()) if model.IsControl(i) or model.IsUnknown(i))

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # sentencepiece never parses control pieces such as "<s>" out of input text.
        ids = self._model.EncodeAsIds(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._model.DecodeIds(list(ids))

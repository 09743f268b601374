"""The Llama 3 tokenizer format: tiktoken byte-level BPE ranks plus Llama 3 special tokens."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import tiktoken

from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

# Llama 3's pre-tokenisation pattern (splits text into words, numbers of up to 3 digits, punctuation
# and whitespace runs before BPE merges are applied).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens of Llama 3, in id order after the BPE ranks."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [
        f"<|reserved_special_token_{i}|>" for i in range(2, NUM_RESERVED_SPECIAL_TOKENS - len(named) + 2)
    ]
    return named + reserved


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a `tokenizer.model` in tiktoken's format: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as err:
        raise DataError(f"tokenizer: cannot read {path}: {err.strerror}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, IndexError) as err:
            raise DataError(
                f"tokenizer: {path} line {number} is not 'base64-token rank'; is this a tiktoken "
                "(Llama 3) tokenizer.model?"
            ) from err
        ranks[token] = rank
    if not ranks:
        raise DataError(f"tokenizer: {path} holds no tokens")
    return ranks


def save_tiktoken_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write BPE ranks in tiktoken's `tokenizer.model` format."""
    lines = [
        f"{base64.b64encode(token).decode()} {rank}"
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    Path(path).write_text("\n".join(lines) + "\n")


class TiktokenBPE(Tokenizer):
    """Byte-level BPE from a tiktoken rank file, with a pre-tokenisation pattern and special tokens
    numbered after the ranks: what the Llama 3 and Kimi K2 formats share (each names its own)."""

    def __init__(
        self,
        path: Path,
        ranks: dict[bytes, int],
        pattern: str,
        special_tokens: dict[str, int],
        bos: str,
        eos: str,
    ):
        self.special_tokens = special_tokens
        self._model = tiktoken.Encoding(
            name=path.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self.bos_id = special_tokens[bos]
        self.eos_id = special_tokens[eos]
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._model.n_vocab

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as plain text, never as control tokens.
        ids = self._model.encode_ordinary(text)
        bos = bos and self.add_bos
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        # disallowed_special=(): special-token text is plain text here too (checked equal to encode_ordinary)
        ids = self._model.encode_to_numpy(text, disallowed_special=())
        bos = bos and self.add_bos
        if not (bos or eos):
            return ids
        framed = np.empty(len(ids) + bos + eos, dtype=np.uint32)
        framed[bos : bos + len(ids)] = ids
        if bos:
            framed[0] = self.bos_id
        if eos:
            framed[-1] = self.eos_id
        return framed

    def encode_chat_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self._model.encode(text, allowed_special="all")
        _, starts = self._model.decode_with_offsets(ids)
        return ids, list(zip(starts, [*starts[1:], len(text)], strict=True))

    def decode(self, ids: list[int]) -> str:
        return self._model.decode(list(ids))


class TikTokenTokenizer(TiktokenBPE):
    """Llama 3 tokenizer: BPE from a tiktoken `tokenizer.model`, special tokens numbered after it."""

    def __init__(self, path: str | Path):
        path = Path(path)
        ranks = load_tiktoken_ranks(path)
        specials = {tok: len(ranks) + i for i, tok in enumerate(llama3_special_tokens())}
        super().__init__(path, ranks, LLAMA3_PATTERN, specials, "<|begin_of_text|>", "<|end_of_text|>")

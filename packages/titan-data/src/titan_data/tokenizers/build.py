"""Pick and build the tokenizer a file or a Hugging Face assets folder (`hf_assets_path`) holds."""

from __future__ import annotations

import re
from pathlib import Path

from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer
from titan_data.tokenizers.hf_json import HuggingFaceTokenizer
from titan_data.tokenizers.kimi_tiktoken import RANK_FILE, KimiTokenizer
from titan_data.tokenizers.sentencepiece_bpe import SentencePieceTokenizer
from titan_data.tokenizers.tiktoken_bpe import TikTokenTokenizer

# In the order a folder is searched. Llama 3 folders from the hub keep the tiktoken file in original/.
TOKENIZER_FILES = ("tokenizer.model", "original/tokenizer.model", "tokenizer.json", RANK_FILE)
TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+\d+\r?$")


def _is_tiktoken_file(path: Path) -> bool:
    """A tiktoken file is text lines 'base64 rank'; a sentencepiece model is a binary protobuf."""
    with open(path, "rb") as f:
        first = f.readline(4096).rstrip(b"\n")
    return bool(TIKTOKEN_LINE.match(first))


def build_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a `tokenizer.model` (tiktoken or sentencepiece) or `tokenizer.json`
    file, or a folder (`hf_assets_path`) holding one of them or Kimi's `tiktoken.model`."""
    path = Path(path)
    if path.is_dir():
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                return build_tokenizer(path / name)
        raise DataError(f"tokenizer: no tokenizer in folder {path}; looked for {', '.join(TOKENIZER_FILES)}")
    if not path.is_file():
        raise DataError(
            f"tokenizer: {path} does not exist; point the config at a folder with {', '.join(TOKENIZER_FILES)}"
        )
    if path.name == RANK_FILE:  # Kimi's layout: the folder's tokenizer_config.json names its tokens
        return KimiTokenizer(path.parent)
    if path.suffix == ".json":
        return HuggingFaceTokenizer(path)
    if _is_tiktoken_file(path):
        return TikTokenTokenizer(path)
    return SentencePieceTokenizer(path)

"""Pick and build the tokenizer a file or an assets folder holds."""

from __future__ import annotations

from pathlib import Path

from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer
from titan_data.tokenizers.tiktoken_bpe import TikTokenTokenizer

TOKENIZER_FILES = ("tokenizer.model",)


def build_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a `tokenizer.model` file, or a folder (`hf_assets_path`) holding one."""
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
    return TikTokenTokenizer(path)

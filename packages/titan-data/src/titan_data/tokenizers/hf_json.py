"""A Hugging Face `tokenizer.json` (the `tokenizers` library), with BOS/EOS named by its config files.

EOS is required (it ends documents and pads rows). BOS is optional, as transformers has it: Qwen's
folders declare `"bos_token": null`. Whether a document starts with BOS follows what transformers and
torchtitan decide for the folder: `add_bos_token` in `tokenizer_config.json` where it is written, else
whether the file's own post-processor puts the declared BOS in front (Llama 3's does, Qwen's does not).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

# Where a Hugging Face assets folder names its document markers, most specific first.
TOKEN_NAME_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TOKEN_ID_FILES = ("generation_config.json", "config.json")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"tokenizer: cannot read {path}: {err}") from err


def _token_name(value) -> str | None:
    """A special token as the config files write it: a string, or an object with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_marker_id(model: HFTokenizer, folder: Path, marker: str) -> int | None:
    """The id of `marker` ("bos" or "eos") as the folder's config files declare it, or None."""
    for name in TOKEN_NAME_FILES:
        if (folder / name).is_file():
            token = _token_name(_read_json(folder / name).get(f"{marker}_token"))
            if token is not None:
                token_id = model.token_to_id(token)
                if token_id is None:
                    raise DataError(
                        f"tokenizer: {folder / name} names {marker}_token '{token}', which "
                        f"{folder / 'tokenizer.json'} does not hold"
                    )
                return token_id
    for name in TOKEN_ID_FILES:
        if (folder / name).is_file():
            value = _read_json(folder / name).get(f"{marker}_token_id")
            if isinstance(value, list) and value:
                value = value[0]  # Llama 3.1 lists several end-of-turn ids; the first ends text
            if isinstance(value, int):
                return value
    return None


def _adds_bos(model: HFTokenizer, folder: Path, bos_id: int) -> bool:
    """Whether a document starts with BOS: the config's `add_bos_token` where written, else the file's
    post-processor (what `encode(text)` with special tokens gives in transformers and torchtitan)."""
    config = folder / TOKEN_NAME_FILES[0]
    if config.is_file():
        written = _read_json(config).get("add_bos_token")
        if isinstance(written, bool):
            return written
    return model.encode("", add_special_tokens=True).ids[:1] == [bos_id]


class HuggingFaceTokenizer(Tokenizer):
    """Any tokenizer saved as `tokenizer.json`; BOS/EOS come from `tokenizer_config.json` (or
    `special_tokens_map.json`, `generation_config.json`, `config.json`) beside it."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            self._model = HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust library raises a bare Exception for malformed files
            raise DataError(
                f"tokenizer: {path} is not a readable tokenizers-library file ({err}); point hf_assets_path at a folder whose tokenizer.json was saved by the tokenizers library"
            ) from err
        # Text like "<|end_of_text|>" inside a document stays text, as with the other tokenizers.
        self._model.encode_special_tokens = True
        self.bos_id = find_marker_id(self._model, path.parent, "bos")
        eos_id = find_marker_id(self._model, path.parent, "eos")
        if eos_id is None:
            raise DataError(
                f"tokenizer: no EOS token declared for {path}; looked in "
                f"{', '.join(TOKEN_NAME_FILES + TOKEN_ID_FILES)} beside it. Add a tokenizer_config.json with "
                '"eos_token"'
            )
        self.eos_id = eos_id
        self.add_bos = self.bos_id is not None and _adds_bos(self._model, path.parent, self.bos_id)
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._model.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        added = self._model.get_added_tokens_decoder()
        markers = {i for i in (self.bos_id, self.eos_id) if i is not None}
        return frozenset({i for i, token in added.items() if token.special} | markers)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # add_special_tokens=False: the file's post-processor may prepend BOS; framing is ours to decide.
        ids = self._model.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.add_bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_chat_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        self._model.encode_special_tokens = False  # the template's markers are control tokens here
        try:
            encoding = self._model.encode(text, add_special_tokens=False)
        finally:
            self._model.encode_special_tokens = True
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    def decode(self, ids: list[int]) -> str:
        return self._model.decode(list(ids), skip_special_tokens=False)

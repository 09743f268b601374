"""A Hugging Face `tokenizer.json` (the `tokenizers` library), with BOS/EOS named by its config files."""

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
        ids = {m: find_marker_id(self._model, path.parent, m) for m in ("bos", "eos")}
        missing = [m for m, i in ids.items() if i is None]
        if missing:
            raise DataError(
                f"tokenizer: no {' or '.join(m.upper() for m in missing)} token declared for {path}; looked in "
                f"{', '.join(TOKEN_NAME_FILES + TOKEN_ID_FILES)} beside it. Add a tokenizer_config.json with "
                '"bos_token" and "eos_token"'
            )
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._model.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        added = self._model.get_added_tokens_decoder()
        return frozenset({i for i, token in added.items() if token.special} | {self.bos_id, self.eos_id})

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # add_special_tokens=False: the file's post-processor may prepend BOS; framing is ours to decide.
        ids = self._model.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_chat(self, text: str) -> list[int]:
        self._model.encode_special_tokens = False  # the template's markers are control tokens here
        try:
            return self._model.encode(text, add_special_tokens=False).ids
        finally:
            self._model.encode_special_tokens = True

    def decode(self, ids: list[int]) -> str:
        return self._model.decode(list(ids), skip_special_tokens=False)

"""Kimi K2's tokenizer folder: `tiktoken.model` (tiktoken BPE ranks) beside a `tokenizer_config.json` whose
`added_tokens_decoder` names special tokens and whose `auto_map` points at Moonshot's `tokenization_kimi`.

What that code computes is encoded here as facts, not run: the 256 ids after the ranks are special tokens,
named by `added_tokens_decoder` where it names them and `<|reserved_token_{id}|>` otherwise; BOS and EOS are
the config's `bos_token` and `eos_token`; text is split before BPE by Kimi's pattern (`KIMI_PATTERN`: Han
runs apart from other letters, words with their case and an English contraction, numbers of up to 3 digits,
punctuation, newlines, spaces); its slow tokenizer adds no BOS unless the config's `add_bos_token` says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_data.errors import DataError
from titan_data.tokenizers.tiktoken_bpe import TiktokenBPE, load_tiktoken_ranks

RANK_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256
_KIMI_CODE = "tokenization_kimi."
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# Kimi K2's pre-tokenisation pattern (character-class intersection `&&` as tiktoken's regex engine reads it).
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class KimiTokenizer(TiktokenBPE):
    """Kimi K2's tokenizer from its folder (see the module)."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        config_path = folder / CONFIG_FILE
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(
                f"tokenizer: {folder}/{RANK_FILE} needs a readable {CONFIG_FILE} beside it ({err})"
            ) from None
        code = ((config.get("auto_map") or {}).get("AutoTokenizer") or [None])[0]
        if code is not None and not str(code).startswith(_KIMI_CODE):
            raise DataError(
                f"tokenizer: {config_path} names custom code {code!r}; Titan reads {RANK_FILE} folders in Kimi's "
                f"layout ({_KIMI_CODE}TikTokenTokenizer) only"
            )
        ranks = load_tiktoken_ranks(folder / RANK_FILE)
        first = len(ranks)
        named = {int(i): _token_text(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
        outside = sorted(i for i in named if not first <= i < first + NUM_RESERVED_SPECIAL_TOKENS)
        if outside:
            raise DataError(
                f"tokenizer: {config_path} names special tokens at ids {outside[:5]}, outside the "
                f"{NUM_RESERVED_SPECIAL_TOKENS} ids after the {first} ranks of {RANK_FILE} that Kimi's layout reserves"
            )
        specials = {
            named.get(i) or f"<|reserved_token_{i}|>": i
            for i in range(first, first + NUM_RESERVED_SPECIAL_TOKENS)
        }
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        for key, token in (("bos_token", bos), ("eos_token", eos)):
            if token not in specials:
                raise DataError(
                    f"tokenizer: {config_path}'s {key} {token!r} is not one of its special tokens"
                )
        super().__init__(folder / RANK_FILE, ranks, KIMI_PATTERN, specials, bos, eos)
        self.add_bos = config.get("add_bos_token") is True

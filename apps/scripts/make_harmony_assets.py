"""Write titan-data's `tokenizer_harmony` test folder: the bundled BPE with gpt-oss's harmony control tokens.

gpt-oss's tokenizer (o200k_harmony) cannot be downloaded here, so the bundled 2048-token tokenizer
(`assets/tokenizer`) stands in: its reserved special tokens are renamed to harmony's (`<|start|>`,
`<|message|>`, `<|channel|>`, `<|end|>`, `<|return|>`, `<|call|>`, `<|constrain|>`), BOS/EOS to
`<|startoftext|>`/`<|endoftext|>`, ids unchanged, and tokenizer_config.json names `<|return|>` as the
end of generation as gpt-oss's does. The folder's `chat_template.jinja` (harmony, written by hand for
Titan from the format's rules) is kept as it is.

    uv run python apps/scripts/make_harmony_assets.py
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "packages/titan-data/src/titan_data/assets"
RENAMED = {
    "<|begin_of_text|>": "<|startoftext|>",
    "<|end_of_text|>": "<|endoftext|>",
    "<|reserved_special_token_2|>": "<|return|>",
    "<|reserved_special_token_3|>": "<|constrain|>",
    "<|reserved_special_token_4|>": "<|channel|>",
    "<|reserved_special_token_5|>": "<|start|>",
    "<|reserved_special_token_6|>": "<|end|>",
    "<|reserved_special_token_7|>": "<|message|>",
    "<|reserved_special_token_8|>": "<|call|>",
}
CONFIG = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|return|>",
    "pad_token": "<|endoftext|>",
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def main() -> None:
    spec = json.loads((ASSETS / "tokenizer" / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["content"] = RENAMED.get(token["content"], token["content"])
    vocab = spec["model"]["vocab"]
    for old, new in RENAMED.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    post = json.dumps(spec.get("post_processor"))
    for old, new in RENAMED.items():
        post = post.replace(old, new)
    spec["post_processor"] = json.loads(post)
    out = ASSETS / "tokenizer_harmony"
    out.mkdir(exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

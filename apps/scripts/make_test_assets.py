"""Rebuild titan-data's bundled test assets: the `c4_test` corpus and the tokenizers trained on it.

The corpus is English prose that every Python install carries: the docstrings of the standard
library, read with `ast` (nothing is imported or downloaded), laid out as C4's JSON lines
(`text`, `timestamp`, `url`). The tokenizer is a byte-level BPE trained on that corpus with the
`tokenizers` library and written in Llama 3's `tokenizer.model` format (tiktoken ranks), so that
1792 BPE tokens plus Llama 3's 256 special tokens make the debug model's vocabulary of 2048.

The same BPE is also written as a Hugging Face `tokenizer.json` (with `tokenizer_config.json` naming
BOS and EOS), numbered like the tiktoken ranks, as a Llama 3 assets folder holds both. A Llama 2 style
sentencepiece `tokenizer.model` (BPE with byte fallback, 2048 pieces) is trained on the same corpus.

    uv run python apps/scripts/make_test_assets.py
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import sys
import sysconfig
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from titan_data.tokenizers.tiktoken_bpe import (
    LLAMA3_PATTERN,
    NUM_RESERVED_SPECIAL_TOKENS,
    llama3_special_tokens,
    save_tiktoken_ranks,
)

ASSETS = Path(__file__).resolve().parents[2] / "packages/titan-data/src/titan_data/assets"
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}


def stdlib_docstrings(root: Path) -> list[tuple[str, str]]:
    """(module, docstring) for every module, class and function docstring of the standard library."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    found.append((module, doc))
    return found


def build_corpus(max_docs: int) -> list[dict]:
    """Documents in C4's JSON-lines layout, in a fixed order."""
    docs = stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))[:max_docs]
    start = dt.datetime(2019, 4, 1, tzinfo=dt.timezone.utc)
    return [
        {
            "text": text,
            "timestamp": (start + dt.timedelta(minutes=7 * i)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "url": f"https://example.com/stdlib/{module}#{i}",
        }
        for i, (module, text) in enumerate(docs)
    ]


def _bytes_of_unicode_alphabet() -> dict[str, int]:
    """Inverse of the byte-level alphabet that `tokenizers` uses to spell raw bytes as characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_level_bpe(texts: list[str], num_tokens: int) -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=num_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def bpe_ranks_of(tokenizer: HFTokenizer) -> dict[bytes, int]:
    """tiktoken ranks of a trained byte-level BPE: the 256 bytes first, then merges in order."""
    to_byte = _bytes_of_unicode_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def hf_tokenizer_json(tokenizer: HFTokenizer, ranks: dict[bytes, int]) -> str:
    """The trained BPE as a `tokenizer.json` whose ids equal the tiktoken ranks, with Llama 3's
    special tokens after them and a post-processor that prepends BOS (as Llama 3's file does)."""
    spec = json.loads(tokenizer.to_str())
    to_char = {b: c for c, b in _bytes_of_unicode_alphabet().items()}
    spec["model"]["vocab"] = {"".join(to_char[b] for b in token): rank for token, rank in ranks.items()}
    vocab = spec["model"]["vocab"]
    spec["model"]["merges"] = [
        m for m in spec["model"]["merges"] if "".join(m.split(" ") if isinstance(m, str) else m) in vocab
    ]
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in llama3_special_tokens()])
    bos = "<|begin_of_text|>"
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, hf.token_to_id(bos))]
    )
    hf.decoder = decoders.ByteLevel()
    return hf.to_str(pretty=True)


def train_llama2_sentencepiece(texts: list[str], vocab_size: int, model_prefix: Path) -> None:
    """A sentencepiece BPE with Llama 2's trainer settings (byte fallback, split digits, identity
    normalisation, unk/bos/eos = 0/1/2), one sentence per line of the corpus."""
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(model_prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.99995,
        max_sentencepiece_length=16,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--max-docs", type=int, default=2000)
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE tokens + 256 special tokens")
    args = parser.parse_args(argv)

    corpus = build_corpus(args.max_docs)
    corpus_dir = args.out / "c4_test"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir / "c4_test.jsonl", "w", encoding="utf-8") as f:
        for doc in corpus:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")

    texts = [d["text"] for d in corpus]
    bpe = _byte_level_bpe(texts, args.vocab_size - NUM_RESERVED_SPECIAL_TOKENS)
    ranks = bpe_ranks_of(bpe)
    tokenizer_dir = args.out / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    save_tiktoken_ranks(ranks, tokenizer_dir / "tokenizer.model")
    (tokenizer_dir / "tokenizer.json").write_text(hf_tokenizer_json(bpe, ranks) + "\n")
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    llama2_dir = args.out / "tokenizer_llama2"
    llama2_dir.mkdir(parents=True, exist_ok=True)
    train_llama2_sentencepiece(texts, args.vocab_size, llama2_dir / "tokenizer")
    (
        llama2_dir / "tokenizer.vocab"
    ).unlink()  # the model file holds the pieces; the vocab listing is for humans
    size = sum(len(d["text"]) for d in corpus)
    print(
        f"wrote {len(corpus)} documents ({size:,} characters) and {len(ranks)} BPE ranks to {args.out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()

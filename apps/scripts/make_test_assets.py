"""Rebuild titan-data's bundled test assets: the `c4_test` corpus and the tokenizer trained on it.

The corpus is English prose that every Python install carries: the docstrings of the standard
library, read with `ast` (nothing is imported or downloaded), laid out as C4's JSON lines
(`text`, `timestamp`, `url`). The tokenizer is a byte-level BPE trained on that corpus with the
`tokenizers` library and written in Llama 3's `tokenizer.model` format (tiktoken ranks), so that
1792 BPE tokens plus Llama 3's 256 special tokens make the debug model's vocabulary of 2048.

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

from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from titan_data.tokenizers.tiktoken_bpe import LLAMA3_PATTERN, NUM_RESERVED_SPECIAL_TOKENS, save_tiktoken_ranks

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
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def train_bpe_ranks(texts: list[str], num_tokens: int) -> dict[bytes, int]:
    """Train byte-level BPE and return tiktoken ranks: the 256 bytes first, then merges in order."""
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
    to_byte = _bytes_of_unicode_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


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

    ranks = train_bpe_ranks([d["text"] for d in corpus], args.vocab_size - NUM_RESERVED_SPECIAL_TOKENS)
    tokenizer_dir = args.out / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    save_tiktoken_ranks(ranks, tokenizer_dir / "tokenizer.model")
    size = sum(len(d["text"]) for d in corpus)
    print(f"wrote {len(corpus)} documents ({size:,} characters) and {len(ranks)} BPE ranks to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

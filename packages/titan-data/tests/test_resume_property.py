"""Exact resume, as a property: for random interruption points, batch sizes and world sizes 1 to 4,
the tokens an interrupted-then-resumed run consumes equal those of an uninterrupted run, also when
the resumed run has another number of ranks (states are saved per rank and re-dealt on load)."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titan_data import (
    MemmapTokenDataset,
    PackedTokenDataset,
    StreamLayout,
    TokenLoader,
    get_source,
    tokenize_to_shards,
)

NUM_STREAMS = 12  # a multiple of every world size from 1 to 4
STEPS = 8
NUM_DOCS = 36  # three documents per stream: runs cross epoch boundaries


@pytest.fixture(scope="module")
def sources(tmp_path_factory, corpus, write_c4_layout, llama3_tokenizer):
    """The same documents three ways: a JSON-lines file (dealt by document), hub-style C4 files (dealt
    by shard) and token shards (memory-mapped)."""
    texts = corpus[:NUM_DOCS]
    root = tmp_path_factory.mktemp("property")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_c4_layout(root / "c4", texts, NUM_STREAMS)
    tokenize_to_shards(
        get_source("json", root / "docs.jsonl"),
        llama3_tokenizer.path,
        root / "shards",
        documents_per_shard=10,
        progress=False,
    )
    return {
        "document": get_source("json", root / "docs.jsonl"),
        "shard": get_source("c4", root / "c4"),
        "memmap": root / "shards",
    }


def _loaders(kind, sources, tokenizer, world, global_batch, seq_len):
    loaders = []
    for rank in range(world):
        streams = StreamLayout(rank, world, NUM_STREAMS)
        if kind == "memmap":
            dataset = MemmapTokenDataset(sources[kind], seq_len, streams=streams)
        else:
            dataset = PackedTokenDataset(sources[kind], tokenizer, seq_len, streams=streams)
            assert dataset.dealing == kind
        loaders.append(TokenLoader(dataset, global_batch // world))
    return loaders


def _steps(loaders, steps):
    """Each step's global batch: the windows of every rank, as a sorted list of token tuples."""
    iterators = [iter(loader) for loader in loaders]
    batches = []
    for _ in range(steps):
        windows = []
        for it in iterators:
            inputs, labels = next(it)
            windows += [tuple(w) for w in torch.cat([inputs, labels[:, -1:]], dim=1).tolist()]
        batches.append(sorted(windows))
    return batches


def _check_resume(kind, sources, tokenizer, worlds, stop, batch_multiple, seq_len):
    reference_world, world_before, world_after = worlds
    global_batch = math.lcm(*worlds) * batch_multiple
    expected = _steps(_loaders(kind, sources, tokenizer, reference_world, global_batch, seq_len), STEPS)

    before = _loaders(kind, sources, tokenizer, world_before, global_batch, seq_len)
    consumed = _steps(before, stop)
    saved = {}
    for loader in before:  # what a checkpoint holds: every rank's entries side by side
        saved.update(loader.state_dict())
    assert sorted(saved) == sorted(f"stream_{j}" for j in range(NUM_STREAMS))
    after = _loaders(kind, sources, tokenizer, world_after, global_batch, seq_len)
    for loader in after:
        loader.load_state_dict(saved)
    consumed += _steps(after, STEPS - stop)
    assert consumed == expected


RUNS = {
    "worlds": st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    "stop": st.integers(0, STEPS),
    "batch_multiple": st.integers(1, 2),
    "seq_len": st.sampled_from([5, 16, 63]),
}
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=50, **SETTINGS)
@given(**RUNS)
def test_resumed_run_consumes_the_same_tokens_dealt_by_document(
    sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len
):
    _check_resume("document", sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len)


@settings(max_examples=50, **SETTINGS)
@given(**RUNS)
def test_resumed_run_consumes_the_same_tokens_from_memory_mapped_shards(
    sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len
):
    _check_resume("memmap", sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len)


@settings(max_examples=10, **SETTINGS)
@given(**RUNS)
def test_resumed_run_consumes_the_same_tokens_from_c4_dealt_by_shard(
    sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len
):
    _check_resume("shard", sources, llama3_tokenizer, worlds, stop, batch_multiple, seq_len)

"""C4 streamed over HTTP from a loopback stand-in for the hub: exact through dropped connections, one
clear line when the hub cannot be reached, and the same positions as a local copy."""

import gzip
import time
from itertools import islice
from pathlib import Path

import pytest
import torch
from c4_hub_server import C4HubServer, unreachable_endpoint

from titan_data import (
    DataError,
    PackedTokenDataset,
    SourceUnavailable,
    StreamLayout,
    TokenLoader,
    check_dataset,
    get_source,
)


@pytest.fixture
def online(monkeypatch):
    """The hub switches of conftest off, fast retries, and HF_ENDPOINT pointed at `hub.url` by the test."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("TITAN_DATA_HTTP_ATTEMPTS", "3")
    monkeypatch.setenv("TITAN_DATA_HTTP_BACKOFF_S", "0.01")
    monkeypatch.setenv("TITAN_DATA_HTTP_TIMEOUT_S", "5")
    return monkeypatch


def _local_copy(hub: C4HubServer, root: Path, split: str, files: int) -> Path:
    """The first `files` files of `split` as the server has them, laid out as on the hub."""
    for index in range(files):
        name = f"en/c4-{split}.{index:05d}-of-{ {'train': 1024, 'validation': 8}[split]:05d}.json.gz"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(hub.file(name))
    return root


def _cut_each(hub: C4HubServer, split: str, files: int, fractions: tuple[float, ...]) -> None:
    """Each of the first `files` files is cut off at each fraction of what remains, one request each."""
    for index in range(files):
        name = f"en/c4-{split}.{index:05d}-of-{ {'train': 1024, 'validation': 8}[split]:05d}.json.gz"
        size, at, cuts = len(hub.file(name)), 0, []
        for fraction in fractions:
            cuts.append(int((size - at) * fraction))
            at += cuts[-1]
        hub.cut[name] = cuts


def test_documents_streamed_through_dropped_connections_equal_an_undisturbed_read(corpus, online, tmp_path):
    with C4HubServer(corpus, docs_per_file=30) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        _cut_each(hub, "train", 3, (0.3, 0.5, 0.5))  # three drops inside each of the first three files
        streamed = list(islice(get_source("c4").read(), 85))
        local = list(islice(get_source("c4", _local_copy(hub, tmp_path, "train", 3)).read(), 85))
        resumed = [r for _, r in hub.requests if r]
    assert streamed == local and len(set(streamed)) == 85
    assert len(resumed) == 9  # every drop was resumed with a Range request, none refetched the file


def test_a_server_that_ignores_ranges_is_read_again_from_the_start_exactly(corpus, online, tmp_path):
    with C4HubServer(corpus, docs_per_file=30) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        hub.ignore_range = True
        _cut_each(hub, "validation", 2, (0.4, 0.4))
        streamed = list(get_source("c4_validation").shard(4, 0).read())  # files 0 and 4; 4 is not cut
        local = list(FileCopy.read(hub, tmp_path, "validation", (0, 4)))
    assert streamed == local and len(streamed) == 60


class FileCopy:
    @staticmethod
    def read(hub: C4HubServer, root: Path, split: str, indices: tuple[int, ...]) -> list[str]:
        import json

        texts = []
        for index in indices:
            data = hub.file(f"en/c4-{split}.{index:05d}-of-00008.json.gz")
            texts += [json.loads(line)["text"] for line in gzip.decompress(data).decode().splitlines()]
        return texts


def _loader(source, tokenizer, rank=0, world=1):
    dataset = PackedTokenDataset(source, tokenizer, 64, streams=StreamLayout(rank, world, 2))
    return TokenLoader(dataset, batch_size=3)


def test_loader_batches_and_resume_through_drops_equal_a_local_copy(
    corpus, online, tmp_path, llama3_tokenizer
):
    """Two streams (shard dealing: files 0, 2, ... and 1, 3, ...), drops in every file read, a save in
    the middle: the streamed batches, and the batches after resuming the stream's state from the local
    copy, are those of the local copy."""
    with C4HubServer(corpus, docs_per_file=3) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        _cut_each(hub, "train", 8, (0.25, 0.5))
        local = get_source("c4", _local_copy(hub, tmp_path, "train", 8))
        expected = list(islice(_loader(local, llama3_tokenizer), 16))
        streamed = _loader(get_source("c4"), llama3_tokenizer)
        first = list(islice(streamed, 7))
        state = streamed.state_dict()
        assert streamed.packed.dealing == "shard" and state["stream_1"] != resumed_from_start(
            llama3_tokenizer
        )
        assert streamed.remote and not _loader(local, llama3_tokenizer).remote  # a trainer agrees per step
        drops = sum(1 for _, r in hub.requests if r)
    resumed = _loader(local, llama3_tokenizer)
    resumed.load_state_dict(state)
    rest = list(islice(resumed, 9))
    for got, want in zip(first + rest, expected, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert drops >= 4  # the drops happened (two per file read) and were resumed


def resumed_from_start(tokenizer) -> bytes:
    return _loader(get_source("c4"), tokenizer).state_dict()["stream_1"]


def test_a_source_that_stays_down_raises_source_unavailable_after_its_retries(
    corpus, online, llama3_tokenizer
):
    with C4HubServer(corpus, docs_per_file=30) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        hub.down_after_bytes = len(hub.file("en/c4-train.00000-of-01024.json.gz")) // 2
        loader = _loader(get_source("c4"), llama3_tokenizer)
        start = time.monotonic()
        with pytest.raises(SourceUnavailable, match=r"stopped answering .* 3 retries"):
            for _ in loader:
                pass
    assert time.monotonic() - start < 30
    assert len(hub.requests) == 1 + 3 + 1  # file 0, its three retries; stream 1's file 1 got nothing either


def test_an_unreachable_hub_is_one_line_naming_the_dataset_and_the_fixes(online, tmp_path):
    with unreachable_endpoint() as url:
        online.setenv("HF_ENDPOINT", url)
        for name in ("c4", "c4_validation"):
            with pytest.raises(DataError) as err:
                check_dataset(name)
            message = str(err.value)
            assert "\n" not in message and f"'{name}' streams allenai/c4 from {url}, but" in message
            assert f"titan-data prepare {name} --output DIR" in message and "HF_DATASETS_OFFLINE=1" in message

    online.setenv("HF_HUB_OFFLINE", "1")
    online.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(DataError, match=r"'c4': the hub is switched off .* holds no en/c4-train"):
        check_dataset("c4")
    with pytest.raises(DataError, match=r"'c4' found no C4 files under .*; on a node with hub access"):
        check_dataset("c4", tmp_path)


def test_offline_with_a_warm_hub_cache_reads_the_cached_files(corpus, online, tmp_path):
    with C4HubServer(corpus, docs_per_file=10) as hub:
        snapshot = tmp_path / "hub" / "datasets--allenai--c4" / "snapshots" / "0123abcd"
        _local_copy(hub, snapshot, "validation", 2)
    online.setenv("HF_DATASETS_OFFLINE", "1")
    online.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    check_dataset("c4_validation")
    texts = list(get_source("c4_validation").read())
    assert texts == FileCopy.read(hub, tmp_path, "validation", (0, 1))

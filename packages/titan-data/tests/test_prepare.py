"""`titan-data prepare` against a loopback stand-in for the hub: resumable without refetching, verified
against the sizes and sha256 the hub lists, and optionally tokenised in the same step."""

import json

import pytest
from c4_hub_server import C4HubServer, unreachable_endpoint

from titan_data import ShardIndex, get_source
from titan_data.cli import main
from titan_data.datasets.registry import ASSETS

NAMES = [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(4)]


@pytest.fixture
def online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("TITAN_DATA_HTTP_ATTEMPTS", "1")
    monkeypatch.setenv("TITAN_DATA_HTTP_BACKOFF_S", "0.01")
    return monkeypatch


def _files_requested(hub: C4HubServer) -> list[tuple[str, str]]:
    return [(path.rsplit("/", 1)[-1], rng) for path, rng in hub.requests if "/resolve/" in path]


def test_an_interrupted_prepare_continues_without_refetching_what_it_has(corpus, online, tmp_path, capsys):
    out = tmp_path / "c4"
    with C4HubServer(corpus, docs_per_file=20, listed={"train": 4}, page_size=3) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        sizes = [len(hub.file(name)) for name in NAMES]
        hub.down_after_bytes = sizes[0] + sizes[1] + sizes[2] // 2  # the hub goes away inside file 2
        assert main(["prepare", "c4", "--output", str(out), "--shards", "4", "--quiet"]) == 3
    assert "stopped answering" in capsys.readouterr().err
    assert [(out / n).is_file() for n in NAMES] == [True, True, False, False]
    kept = (out / f"{NAMES[2]}.part").stat().st_size
    assert kept == sizes[2] // 2

    with C4HubServer(corpus, docs_per_file=20, listed={"train": 4}, page_size=3) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        assert main(["prepare", "c4", "--output", str(out), "--shards", "4", "--quiet"]) == 0
        assert _files_requested(hub) == [
            (NAMES[2].split("/")[1], f"bytes={kept}-"),
            (NAMES[3].split("/")[1], ""),
        ]
        assert [(out / n).read_bytes() for n in NAMES] == [hub.file(n) for n in NAMES]
    assert sorted(p.name for p in (out / "en").iterdir()) == [n.split("/")[1] for n in NAMES]  # no .part left
    assert len(list(get_source("c4", out).read())) == 80


def test_a_corrupt_download_is_refused_and_a_corrupt_copy_found_by_verify(corpus, online, tmp_path, capsys):
    out = tmp_path / "c4"
    with C4HubServer(corpus, docs_per_file=10, listed={"train": 2}) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        hub.corrupt = {NAMES[1]}  # the bytes the hub sends differ from the sha256 it lists
        assert main(["prepare", "c4", "--output", str(out), "--shards", "2", "--quiet"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{NAMES[1]} arrived as" in error and "sha256" in error
        assert (out / NAMES[0]).is_file() and not (out / NAMES[1]).exists()
        assert not (out / f"{NAMES[1]}.part").exists()

        hub.corrupt = set()
        assert main(["prepare", "c4", "--output", str(out), "--shards", "2", "--quiet"]) == 0
        # a byte flipped on disk later: same size, so only --verify finds it, and fetches the file again
        damaged = bytearray((out / NAMES[0]).read_bytes())
        damaged[50] ^= 0xFF
        (out / NAMES[0]).write_bytes(bytes(damaged))
        assert main(["prepare", "c4", "--output", str(out), "--shards", "2", "--quiet"]) == 0
        assert (out / NAMES[0]).read_bytes() == bytes(damaged)
        assert main(["prepare", "c4", "--output", str(out), "--shards", "2", "--quiet", "--verify"]) == 0
        assert (out / NAMES[0]).read_bytes() == hub.file(NAMES[0])


def test_prepare_tokenizes_into_token_shards_in_the_same_step(corpus, online, tmp_path, llama3_tokenizer):
    with C4HubServer(corpus, docs_per_file=10, listed={"validation": 8}) as hub:
        online.setenv("HF_ENDPOINT", hub.url)
        argv = [
            "prepare",
            "c4_validation",
            "--output",
            str(tmp_path / "c4"),
            "--quiet",
            "--tokenize-to",
            str(tmp_path / "tokens"),
            "--tokenizer",
            str(ASSETS / "tokenizer"),
        ]
        assert main(argv) == 0
        texts = [
            json.loads(line)["text"]
            for n in range(8)
            for line in __import__("gzip")
            .decompress(hub.file(f"en/c4-validation.{n:05d}-of-00008.json.gz"))
            .splitlines()
        ]
    index = ShardIndex.load(tmp_path / "tokens")
    assert index.complete and index.num_documents == 80 == len(texts)
    assert index.num_tokens == sum(len(llama3_tokenizer.encode(t, bos=True, eos=True)) for t in texts)


def test_prepare_without_hub_access_says_so_in_one_line(online, tmp_path, capsys):
    with unreachable_endpoint() as url:
        online.setenv("HF_ENDPOINT", url)
        assert main(["prepare", "c4", "--output", str(tmp_path), "--shards", "1", "--quiet"]) == 3
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"the hub at {url} did not list allenai/c4" in error

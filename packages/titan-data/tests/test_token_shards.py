import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_data import (
    DATASETS,
    DataError,
    IterableSource,
    MemmapTokenDataset,
    PackedTokenDataset,
    ShardIndex,
    StreamLayout,
    TokenLoader,
    build_dataset,
    build_tokenizer,
    get_source,
    register_dataset,
    tokenize_to_shards,
)
from titan_data.cli import main
from titan_data.datasets.registry import ASSETS
from titan_data.tokenize_job import tokenize_documents
from titan_data.tokenizers.tiktoken_bpe import save_tiktoken_ranks

TOKENIZER = ASSETS / "tokenizer"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _documents(folder: Path) -> list[list[int]]:
    """Every document's tokens, read back from the shard files through the index."""
    index, docs = ShardIndex.load(folder), []
    for shard in index.shards:
        tokens = np.fromfile(folder / f"{shard.name}.bin", dtype=index.dtype)
        offsets = np.fromfile(folder / f"{shard.name}.idx", dtype=np.uint64)
        docs += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return docs


@pytest.fixture(scope="module")
def docs_jsonl(tmp_path_factory, corpus) -> Path:
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus[:100]))
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory, docs_jsonl) -> Path:
    out = tmp_path_factory.mktemp("shards")
    tokenize_to_shards(get_source("json", docs_jsonl), TOKENIZER, out, documents_per_shard=40, progress=False)
    return out


def test_the_cli_writes_framed_uint16_shards_and_an_index_with_several_workers(
    tmp_path, corpus, llama3_tokenizer
):
    out = tmp_path / "tokens"
    script = Path(sys.executable).parent / "titan-data"  # the installed entry point
    cmd = [
        str(script),
        "tokenize",
        "--input",
        "c4_test",
        "--output",
        str(out),
        "--tokenizer",
        str(TOKENIZER),
        "--workers",
        "2",
        "--documents-per-shard",
        "700",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2,000 documents" in result.stdout and "(uint16)" in result.stdout
    assert "tokenize: 2000 docs" in result.stderr  # the progress bar
    index = ShardIndex.load(out)
    assert index.complete and index.dtype == "uint16"
    assert [s.documents for s in index.shards] == [700, 700, 600]
    assert index.tokenizer["vocab_size"] == 2048 and index.tokenizer["bos_id"] == llama3_tokenizer.bos_id
    assert _documents(out) == [llama3_tokenizer.encode(t, bos=True, eos=True) for t in corpus]

    one_worker = tmp_path / "one"
    tokenize_to_shards(get_source("c4_test"), TOKENIZER, one_worker, documents_per_shard=700, progress=False)
    assert _files(one_worker) == _files(out)


def test_an_interrupted_run_continues_to_the_same_shards(tmp_path, corpus, capsys):
    texts, interrupts = corpus[:300], [True]

    def documents():
        for i, text in enumerate(texts):
            if i == 280 and interrupts:
                interrupts.pop()
                raise KeyboardInterrupt  # Ctrl-C while the 281st document is read
            yield text

    register_dataset("interrupted_for_test", lambda path: IterableSource("interrupted_for_test", documents))
    try:
        out = tmp_path / "out"
        args = [
            "tokenize",
            "--input",
            "interrupted_for_test",
            "--output",
            str(out),
            "--tokenizer",
            str(TOKENIZER),
            "--documents-per-shard",
            "50",
            "--workers",
            "2",
            "--quiet",
        ]
        assert main(args) == 130
        assert "interrupted; finished shards are kept" in capsys.readouterr().err
        index = ShardIndex.load(out)
        # shards still with the workers are lost, and done again on the next run
        assert not index.complete and 1 <= len(index.shards) < 6
        assert all(s.documents == 50 for s in index.shards)
        (out / "shard_00005.bin.tmp").write_bytes(b"half-written by a killed run")
        assert main(args) == 0
    finally:
        del DATASETS["interrupted_for_test"]
    whole = tmp_path / "whole"
    tokenize_to_shards(
        IterableSource("interrupted_for_test", lambda: texts),
        TOKENIZER,
        whole,
        documents_per_shard=50,
        progress=False,
    )
    assert _files(out) == _files(whole)


def test_c4_continues_from_the_position_saved_in_the_index(tmp_path, c4_folder, c4_texts, llama3_tokenizer):
    whole = tmp_path / "whole"
    tokenize_to_shards(get_source("c4", c4_folder), TOKENIZER, whole, documents_per_shard=50, progress=False)
    # the files as on the hub hold documents f, f + 12, ... in file f
    in_file_order = [t for f in range(12) for t in c4_texts[f::12]]
    assert _documents(whole) == [llama3_tokenizer.encode(t, bos=True, eos=True) for t in in_file_order]
    # a run stopped after two shards: its index lists them, with the source position after each
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    index = ShardIndex.load(whole)
    for entry in index.shards[:2]:
        for suffix in (".bin", ".idx"):
            (stopped / f"{entry.name}{suffix}").write_bytes((whole / f"{entry.name}{suffix}").read_bytes())
    assert index.shards[1].resume == [4, 12477]  # (file, decompressed byte offset), stored as JSON
    index.shards, index.complete = index.shards[:2], False
    index.save(stopped)
    tokenize_to_shards(
        get_source("c4", c4_folder), TOKENIZER, stopped, documents_per_shard=50, progress=False
    )
    assert _documents(stopped) == _documents(whole)
    # (the index's saved states may spell the same position differently, so shard files are compared)
    assert {k: v for k, v in _files(stopped).items() if k != "index.json"} == {
        k: v for k, v in _files(whole).items() if k != "index.json"
    }


def test_continuing_with_other_settings_is_refused(tmp_path, docs_jsonl):
    tokenize_to_shards(
        get_source("json", docs_jsonl), TOKENIZER, tmp_path, documents_per_shard=40, progress=False
    )
    with pytest.raises(DataError, match="different documents_per_shard; give a new --output folder"):
        tokenize_to_shards(
            get_source("json", docs_jsonl), TOKENIZER, tmp_path, documents_per_shard=30, progress=False
        )
    with pytest.raises(DataError, match="different tokenizer"):
        tokenize_to_shards(
            get_source("json", docs_jsonl), ASSETS / "tokenizer_llama2", tmp_path, documents_per_shard=40
        )


def test_a_vocabulary_above_65536_ids_is_stored_as_uint32(tmp_path, corpus):
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({bytes([a, b]): 256 + a * 256 + b for a in range(256) for b in range(256)})
    save_tiktoken_ranks(ranks, tmp_path / "tokenizer.model")
    big = build_tokenizer(tmp_path)
    assert big.vocab_size == 65792 + 256 and big.bos_id > 65535
    source = IterableSource("few", lambda: corpus[:5])
    index = tokenize_to_shards(source, tmp_path / "tokenizer.model", tmp_path / "out", progress=False)
    assert index.dtype == "uint32"
    assert _documents(tmp_path / "out") == [big.encode(t, bos=True, eos=True) for t in corpus[:5]]


def test_an_input_without_documents_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    assert (
        main(
            [
                "tokenize",
                "--input",
                str(tmp_path / "empty.jsonl"),
                "--output",
                str(tmp_path / "out"),
                "--tokenizer",
                str(TOKENIZER),
                "--quiet",
            ]
        )
        == 2
    )
    with pytest.raises(DataError, match="holds no documents"):
        tokenize_to_shards(get_source("json", tmp_path), TOKENIZER, tmp_path / "out", progress=False)


def test_an_unknown_input_names_the_datasets_and_paths_it_accepts(tmp_path, capsys):
    assert main(["tokenize", "--input", "c5", "--output", str(tmp_path), "--tokenizer", str(TOKENIZER)]) == 2
    assert "'c5' is neither a registered dataset (c4, c4_test" in capsys.readouterr().err


@pytest.mark.parametrize("streams", [1, 3])
def test_memory_mapped_windows_equal_the_windows_packed_on_the_fly(
    shards, docs_jsonl, llama3_tokenizer, streams
):
    for infinite, batches in ((False, None), (True, 200)):  # 200 batches of 4 x 65 tokens: past two epochs
        on_the_fly = PackedTokenDataset(
            get_source("json", docs_jsonl),
            llama3_tokenizer,
            64,
            streams=StreamLayout(num_streams=streams),
            infinite=infinite,
        )
        mapped = MemmapTokenDataset(shards, 64, streams=StreamLayout(num_streams=streams), infinite=infinite)
        a = [b[0] for b in islice(TokenLoader(on_the_fly, 4), batches)]
        b = [b[0] for b in islice(TokenLoader(mapped, 4), batches)]
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_token_shards_by_name_check_the_run_uses_the_same_tokenizer(shards, llama3_tokenizer):
    dataset = build_dataset(
        "token_shards", shards, llama3_tokenizer, 32, streams=StreamLayout(rank=1, world_size=2)
    )
    assert isinstance(dataset, MemmapTokenDataset) and dataset.owned == [1]
    with pytest.raises(
        DataError, match=r"tokenised with tokenizer.model \(vocab_size 2048, bos 1792, eos 1793\), but"
    ):
        build_dataset("token_shards", shards, build_tokenizer(ASSETS / "tokenizer_llama2"), 32)
    with pytest.raises(DataError, match="'token_shards' needs dataset_path"):
        build_dataset("token_shards", None, llama3_tokenizer, 32)


def test_unfinished_or_damaged_shard_folders_are_refused(shards, tmp_path):
    for entry in shards.iterdir():
        (tmp_path / entry.name).write_bytes(entry.read_bytes())
    index = ShardIndex.load(tmp_path)
    index.complete = False
    index.save(tmp_path)
    with pytest.raises(
        DataError, match="is unfinished \\(3 shards so far\\); run the same `titan-data tokenize`"
    ):
        MemmapTokenDataset(tmp_path, 16)
    index.complete = True
    index.save(tmp_path)
    (tmp_path / "shard_00001.bin").write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match="shard_00001.bin is missing or not .* bytes as index.json says"):
        MemmapTokenDataset(tmp_path, 16)


def test_tokenize_documents_frames_each_document(llama3_tokenizer):
    tokens, lengths = tokenize_documents(llama3_tokenizer, ["a b", "", "c"], "uint16")
    assert lengths.tolist() == [
        len(llama3_tokenizer.encode("a b")) + 2,
        2,
        len(llama3_tokenizer.encode("c")) + 2,
    ]
    assert (
        tokens.dtype == np.uint16
        and tokens[0] == llama3_tokenizer.bos_id
        and tokens[-1] == llama3_tokenizer.eos_id
    )

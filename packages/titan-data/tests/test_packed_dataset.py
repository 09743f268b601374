import json
from itertools import islice

import pytest
import torch

from titan_data import (
    DataError,
    IterableSource,
    PackedTokenDataset,
    StreamLayout,
    Tokenizer,
    TokenLoader,
    get_source,
)


def _loader(tokenizer, rank=0, world=1, streams=0, batch=4, seq_len=64, infinite=True, source=None):
    dataset = PackedTokenDataset(
        source or get_source("c4_test"),
        tokenizer,
        seq_len,
        streams=StreamLayout(rank, world, streams),
        infinite=infinite,
    )
    return TokenLoader(dataset, batch)


class RecordingTokenizer(Tokenizer):
    """The real tokenizer, noting every text it is asked to encode (what a rank read and kept)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, []
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id

    @property
    def vocab_size(self):
        return self.tokenizer.vocab_size

    def encode(self, text, *, bos=False, eos=False):
        self.seen.append(text)
        return self.tokenizer.encode(text, bos=bos, eos=eos)

    def decode(self, ids):
        return self.tokenizer.decode(ids)


def test_windows_are_seq_len_shifted_pairs(llama3_tokenizer):
    inputs, labels = next(iter(_loader(llama3_tokenizer, seq_len=32)))
    assert inputs.shape == labels.shape == (4, 32)
    assert inputs.dtype == labels.dtype == torch.long and inputs.is_contiguous() and labels.is_contiguous()
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_documents_are_framed_by_bos_and_eos(llama3_tokenizer):
    inputs, _ = next(iter(_loader(llama3_tokenizer, seq_len=256, batch=8)))
    assert inputs[0, 0].item() == llama3_tokenizer.bos_id
    ends = (inputs[:, :-1] == llama3_tokenizer.eos_id).nonzero().tolist()
    assert ends and all(inputs[row, col + 1].item() == llama3_tokenizer.bos_id for row, col in ends)


def _shares(tokenizer, source, world, streams):
    """The texts each rank tokenised in one pass over a finite source."""
    shares = []
    for rank in range(world):
        recorder = RecordingTokenizer(tokenizer)
        dataset = PackedTokenDataset(
            source, recorder, 8, streams=StreamLayout(rank, world, streams), infinite=False
        )
        list(dataset)
        shares.append(recorder.seen)
    return dataset.dealing, shares


def _assert_disjoint_and_covering(shares, texts):
    seen = [text for share in shares for text in share]
    assert len(seen) == len(set(seen)), "a document was read by two ranks or twice by one"
    assert set(seen) == set(texts), "a document of the epoch was read by no rank"


def test_four_ranks_read_disjoint_shares_that_cover_the_epoch(llama3_tokenizer, corpus, tmp_path):
    texts = [f"doc{i} {text}" for i, text in enumerate(corpus[:101])]  # unique, and not a multiple of 4
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    dealing, shares = _shares(llama3_tokenizer, get_source("json", path), 4, 4)
    assert dealing == "document"
    _assert_disjoint_and_covering(shares, texts)
    assert [len(s) for s in shares] == [26, 25, 25, 25]


def test_with_c4_shards_each_of_four_ranks_reads_only_its_own_files(llama3_tokenizer, c4_folder, c4_texts):
    dealing, shares = _shares(llama3_tokenizer, get_source("c4", c4_folder), 4, 4)
    assert dealing == "shard"
    _assert_disjoint_and_covering(shares, c4_texts)
    for rank, share in enumerate(
        shares
    ):  # file f holds documents f, f + 12, ...; rank r reads files r, r + 4, r + 8
        assert {c4_texts.index(t) % 12 % 4 for t in share} == {rank}


def test_uneven_c4_shards_fall_back_to_dealing_documents(llama3_tokenizer, c4_folder, c4_texts, caplog):
    dealing, shares = _shares(llama3_tokenizer, get_source("c4", c4_folder), 3, 9)
    assert dealing == "document"
    assert "12 shards are not a multiple of num_streams (9)" in caplog.text
    _assert_disjoint_and_covering(shares, c4_texts)


@pytest.mark.parametrize("dataset", ["c4_test", "c4"])
def test_global_batch_is_the_same_set_of_windows_at_any_world_size(llama3_tokenizer, c4_folder, dataset):
    source = get_source(dataset, c4_folder if dataset == "c4" else None)
    one = next(iter(_loader(llama3_tokenizer, world=1, streams=4, batch=8, source=source)))[0]
    quarters = [
        next(iter(_loader(llama3_tokenizer, rank=r, world=4, streams=4, batch=2, source=source)))[0]
        for r in range(4)
    ]
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, torch.cat(quarters).tolist()))


def test_resume_continues_exactly_where_the_state_was_taken(llama3_tokenizer):
    loader = _loader(llama3_tokenizer)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = [b[0] for b in islice(it, 3)]
    resumed = _loader(llama3_tokenizer)
    resumed.load_state_dict(state)
    got = [b[0] for b in islice(iter(resumed), 3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def _resume_after_damaging_what_was_read(tokenizer, source, damage, steps=12, seq_len=16):
    """Windows after `steps` batches, uninterrupted and resumed after `damage` spoiled the data read so far."""
    loader = _loader(tokenizer, source=source, seq_len=seq_len, batch=2)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.state_dict()
    expected = [b[0] for b in islice(it, 5)]
    damage()
    resumed = _loader(tokenizer, source=source, seq_len=seq_len, batch=2)
    resumed.load_state_dict(state)
    return expected, [b[0] for b in islice(iter(resumed), 5)]


def test_resume_seeks_into_a_local_file_instead_of_reading_it_again(llama3_tokenizer, corpus, tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": t}) for t in corpus[:60]]
    path.write_text("\n".join(lines) + "\n")

    def damage():  # the first lines, already read, become garbage of the same length
        head = len(lines[0]) + len(lines[1]) + 2
        path.write_bytes(b"#" * head + path.read_bytes()[head:])

    expected, got = _resume_after_damaging_what_was_read(llama3_tokenizer, get_source("json", path), damage)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_resume_of_streamed_c4_skips_files_already_read(
    llama3_tokenizer, c4_texts, write_c4_layout, tmp_path
):
    write_c4_layout(tmp_path, c4_texts[:120], 4)
    first_file = tmp_path / "en" / "c4-train.00000-of-01024.json.gz"

    def damage():
        first_file.write_bytes(b"not gzip at all")

    # 55 batches of 2 x 129 tokens (about 14000; the 30 documents of a file hold about 5500): in the third
    # file. The streamed dataset's state re-reads at most the file before the one it stopped in.
    source = get_source("c4", tmp_path)
    expected, got = _resume_after_damaging_what_was_read(
        llama3_tokenizer, source, damage, steps=55, seq_len=128
    )
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_state_saved_on_one_rank_is_dealt_to_two(llama3_tokenizer):
    loader = _loader(llama3_tokenizer, streams=2, batch=8)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = next(it)[0]
    parts = []
    for rank in range(2):
        part = _loader(llama3_tokenizer, rank=rank, world=2, streams=2, batch=4)
        part.load_state_dict(state)
        parts.append(next(iter(part))[0])
    assert sorted(map(tuple, expected.tolist())) == sorted(map(tuple, torch.cat(parts).tolist()))


def test_a_finite_pass_emits_every_full_window_of_every_stream(llama3_tokenizer, corpus):
    seq_len, texts = 16, corpus[:30]
    source = IterableSource("thirty", lambda: texts)
    windows = [
        w
        for batch in _loader(llama3_tokenizer, streams=3, seq_len=seq_len, infinite=False, source=source)
        for w in batch[0]
    ]
    per_stream = [
        sum(len(llama3_tokenizer.encode(t, bos=True, eos=True)) for t in texts[j::3]) for j in range(3)
    ]
    assert len(windows) == sum(n // (seq_len + 1) for n in per_stream)


def test_resuming_with_another_num_streams_is_refused(llama3_tokenizer):
    state = _loader(llama3_tokenizer, streams=2).state_dict()
    with pytest.raises(DataError, match=r"written with num_streams 2 \(now 3\)"):
        _loader(llama3_tokenizer, streams=3).load_state_dict({**state, "stream_2": state["stream_0"]})
    with pytest.raises(DataError, match="lacks stream_2; was it saved with fewer streams"):
        _loader(llama3_tokenizer, streams=3).load_state_dict(state)


def test_resuming_with_another_dataset_is_refused(llama3_tokenizer, tmp_path):
    state = _loader(llama3_tokenizer).state_dict()
    (tmp_path / "d.txt").write_text("one\n")
    with pytest.raises(DataError, match=r"written with source c4_test \(now text\)"):
        _loader(llama3_tokenizer, source=get_source("text", tmp_path)).load_state_dict(state)


def test_empty_dataset_is_a_clear_error(llama3_tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="holds no documents"):
        next(iter(_loader(llama3_tokenizer, source=get_source("json", empty))))


def test_fewer_documents_than_streams_is_a_clear_error(llama3_tokenizer):
    source = IterableSource("two", lambda: ["a b c", "d e f"])
    with pytest.raises(DataError, match=r"holds 2 documents, fewer than num_streams \(3\)"):
        next(iter(_loader(llama3_tokenizer, streams=3, source=source)))


def test_more_ranks_than_streams_is_refused(llama3_tokenizer):
    with pytest.raises(
        DataError, match="num_streams \\(2\\) is smaller than the data-parallel degree \\(4\\)"
    ):
        _loader(llama3_tokenizer, rank=0, world=4, streams=2)


def test_a_tokenizer_without_bos_packs_documents_as_transformers_encodes_them(tmp_path, corpus):
    """Qwen's tokenizer folders declare no BOS (`"bos_token": null`) and add none: pretraining documents
    are transformers' ids of each text, each followed by EOS, back to back."""
    transformers = pytest.importorskip("transformers")
    from titan_data import build_tokenizer
    from titan_data.datasets.registry import ASSETS

    data = json.loads((ASSETS / "tokenizer" / "tokenizer.json").read_text())
    data["post_processor"] = None  # as Qwen's tokenizer.json: nothing put in front
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": None, "eos_token": "<|end_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    tokenizer = build_tokenizer(tmp_path)
    assert tokenizer.bos_id is None and not tokenizer.add_bos
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    inputs, labels = next(iter(_loader(tokenizer, seq_len=256, batch=4, infinite=False)))
    stream = [i for text in corpus[:40] for i in [*theirs(text)["input_ids"], theirs.eos_token_id]]
    assert torch.cat([inputs, labels[:, -1:]], dim=1)[0].tolist() == stream[:257]
    assert 1792 not in inputs.unique().tolist()  # no <|begin_of_text|> anywhere

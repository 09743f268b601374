"""The data people have: `save_to_disk` folders, named splits, weighted mixtures, held-out shares.

References are written in the tests: the shares are compared with the weights themselves, the saved
rows with what `datasets` wrote, and a resumed mixture with the uninterrupted run of the same loader.
"""

import json
from collections import Counter
from itertools import islice

import datasets
import numpy as np
import pytest

from titan_data import (
    ChatDataset,
    DataError,
    FileSource,
    HoldoutSource,
    MixtureSource,
    PackedTokenDataset,
    RowFields,
    StreamLayout,
    TokenLoader,
    get_source,
    mix_rows,
    split_rows,
)
from titan_data.chat.dataset import Example
from titan_data.chat.rows import read_chat_rows


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def two_sources(tmp_path):
    """Source a: 800 documents "a0 ..."; source b: 90 documents "b0 ...", each tagged with its origin."""
    a = _jsonl(tmp_path / "a.jsonl", [f"a{i} river stone light" for i in range(800)])
    b = _jsonl(tmp_path / "b.jsonl", [f"b{i} paper garden signal winter" for i in range(90)])
    return FileSource.from_path("json", a), FileSource.from_path("json", b)


def test_a_mixture_draws_within_one_percent_of_its_weights_over_1000_rows(two_sources):
    mixture = MixtureSource(two_sources, [0.7, 0.3])
    rows = list(islice(mixture.read(), 1000))
    counts = Counter(text[0] for text in rows)
    assert abs(counts["a"] / 1000 - 0.7) < 0.01 and abs(counts["b"] / 1000 - 0.3) < 0.01
    # at every prefix, not only at 1,000: each source is within one document of its share
    for n in (10, 37, 100, 333):
        head = Counter(t[0] for t in rows[:n])
        assert abs(head["a"] - 0.7 * n) <= 1, n
    # each source's documents arrive in its own order, the smaller one starting again when it ends
    assert [t for t in rows if t[0] == "b"][:92] == [
        f"b{i % 90} paper garden signal winter" for i in range(92)
    ]
    assert [t for t in rows if t[0] == "a"][:5] == [f"a{i} river stone light" for i in range(5)]


def test_weights_must_match_the_sources(two_sources):
    with pytest.raises(DataError, match="3 weights for 2 sources"):
        MixtureSource(two_sources, [0.5, 0.3, 0.2])
    with pytest.raises(DataError, match="must all be above 0"):
        MixtureSource(two_sources, [1.0, 0.0])


def test_one_pass_of_a_mixture_reads_every_source_whole(two_sources, caplog):
    caplog.set_level("INFO")
    rows = list(MixtureSource(two_sources, [0.5, 0.5]).read())
    # each source's rows are logged when it first ends
    assert "ended after 90 of the mixture's 181 documents (weight 0.5)" in caplog.text
    assert "ended after 800 of the mixture's 1600 documents (weight 0.5)" in caplog.text
    # b (90 documents) ends first and starts again; the pass ends when a's 800 are read
    assert Counter(t[0] for t in rows) == {"a": 800, "b": 800}


@pytest.mark.parametrize("num_streams", [1, 3])
@pytest.mark.parametrize("stop", [1, 7, 40])
def test_a_mixture_resumed_mid_stream_continues_the_uninterrupted_sequence(
    two_sources, llama3_tokenizer, num_streams, stop
):
    def loader():
        mixture = MixtureSource(two_sources, [0.7, 0.3])
        dataset = PackedTokenDataset(mixture, llama3_tokenizer, 32, streams=StreamLayout(0, 1, num_streams))
        return TokenLoader(dataset, batch_size=2)

    whole = [b[0].tolist() for b in islice(loader(), stop + 60)]
    first = loader()
    batches = iter(first)
    head = [b[0].tolist() for b in islice(batches, stop)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in islice(resumed, 60)]
    assert head + rest == whole


def test_a_checkpoint_of_one_mixture_is_refused_by_another(two_sources, llama3_tokenizer):
    def dataset(weights):
        return PackedTokenDataset(MixtureSource(two_sources, weights), llama3_tokenizer, 32)

    first = dataset([0.7, 0.3])
    next(iter(first))
    with pytest.raises(DataError, match="resume with the same dataset"):
        dataset([0.5, 0.5]).load_state_dict(first.state_dict())


def test_chat_rows_mix_by_weight_and_resume_exactly():
    a = [Example(np.full(5, 1), np.full(5, 1)) for _ in range(800)]
    b = [Example(np.full(7, 2), np.full(7, 2)) for _ in range(40)]
    mixed = mix_rows([a, b], [0.7, 0.3], ["a", "b"])
    head = Counter(int(e.inputs[0]) for e in mixed[:1000])
    assert abs(head[1] / 1000 - 0.7) < 0.01
    assert Counter(int(e.inputs[0]) for e in mixed)[1] == 800  # one pass: a is read whole once

    def loader():
        return TokenLoader(ChatDataset(mixed, 16, streams=StreamLayout(0, 1, 2)), batch_size=2)

    whole = [[t.tolist() for t in b] for b in islice(loader(), 50)]
    first = loader()
    head = [[t.tolist() for t in b] for b in islice(first, 20)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert head + [[t.tolist() for t in b] for b in islice(resumed, 30)] == whole


def test_save_to_disk_folders_and_named_splits_load(tmp_path):
    texts = [f"document {i} about rivers" for i in range(25)]
    datasets.Dataset.from_dict({"text": texts, "id": list(range(25))}).save_to_disk(tmp_path / "one")
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:20]}),
            "test": datasets.Dataset.from_dict({"text": texts[20:]}),
        }
    )
    splits.save_to_disk(tmp_path / "dict")
    # a saved Dataset: its rows, not its state.json read as a JSON lines file
    assert list(get_source("json", tmp_path / "one").read()) == texts
    # a saved DatasetDict: train by default, any split by name
    assert list(get_source("json", tmp_path / "dict").read()) == texts[:20]
    assert list(get_source("json", tmp_path / "dict", "test").read()) == texts[20:]
    with pytest.raises(DataError, match="has no split 'validation'; its splits are test, train"):
        get_source("json", tmp_path / "dict", "validation")
    with pytest.raises(DataError, match="no splits to choose from"):
        get_source("json", tmp_path / "one", "test")
    # resuming from a saved position reads exactly the rest
    reader = get_source("json", tmp_path / "one").open()
    head = list(islice(reader, 11))
    assert head + list(get_source("json", tmp_path / "one").open(reader.position())) == texts


def test_a_dataset_dict_without_train_needs_a_split(tmp_path):
    rows = datasets.Dataset.from_dict({"text": ["x"]})
    datasets.DatasetDict({"dev": rows, "eval": rows}).save_to_disk(tmp_path / "d")
    with pytest.raises(DataError, match="holds the splits dev, eval; choose one with dataset_split"):
        get_source("json", tmp_path / "d")


def test_a_split_of_a_local_folder_follows_the_hub_file_names(tmp_path):
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "train-00000-of-00001.jsonl", ["t0", "t1", "t2"])
    _jsonl(tmp_path / "data" / "test-00000-of-00001.jsonl", ["e0", "e1"])
    assert list(get_source("json", tmp_path / "data", "test").read()) == ["e0", "e1"]
    assert list(get_source("json", tmp_path / "data", "train").read()) == ["t0", "t1", "t2"]


def test_chat_rows_load_from_save_to_disk_and_a_named_split(tmp_path):
    def conversation(i):
        return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"messages": conversation(i)} for i in range(4)]),
            "test": datasets.Dataset.from_list([{"prompt": "p", "completion": "c"}]),
        }
    )
    splits.save_to_disk(tmp_path / "chat")
    train = [row.messages for row in read_chat_rows(tmp_path / "chat", RowFields())]
    assert train == [conversation(i) for i in range(4)]
    test = [row.messages for row in read_chat_rows(tmp_path / "chat", RowFields(), "test")]
    assert test == [[{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]]


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_a_held_out_share_never_overlaps_the_training_rows(two_sources, share):
    source = two_sources[0]  # 800 distinct documents
    train = list(HoldoutSource(source, share, "train").read())
    held = list(HoldoutSource(source, share, "holdout").read())
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(source.read())
    assert abs(len(held) - share * 800) <= 2
    # the same rows on every read, and from a resumed position
    reader = HoldoutSource(source, share, "train").open()
    head = list(islice(reader, 123))
    assert head + list(HoldoutSource(source, share, "train").open(reader.position())) == train
    # rows in memory (chat) split by the same rule
    assert list(split_rows(list(source.read()), share, "holdout")) == held


class _Recording(PackedTokenDataset):
    """A packed dataset that records every document it tokenises."""

    def _encode(self, text):
        self.read.append(text)
        return super()._encode(text)


def test_held_out_rows_are_the_same_on_every_rank(two_sources, llama3_tokenizer):
    """Two ranks packing the train part read together exactly the rows the holdout leaves out."""
    source = two_sources[0]
    held = set(HoldoutSource(source, 0.1, "holdout").read())
    read = []
    for rank in range(2):
        dataset = _Recording(
            HoldoutSource(source, 0.1, "train"),
            llama3_tokenizer,
            64,
            streams=StreamLayout(rank, 2),
            infinite=False,
        )
        dataset.read = read
        for _ in dataset.windows():
            pass
    assert not set(read) & held
    assert len(read) == len(set(read)) and len(read) + len(held) == 800


def test_c4_reads_the_split_named(tmp_path, write_c4_layout, corpus):
    write_c4_layout(tmp_path, corpus[:16], 8, split="validation")
    assert sorted(get_source("c4", tmp_path, "validation").read()) == sorted(corpus[:16])
    with pytest.raises(DataError, match="'c4' has the splits train, validation, not 'test'"):
        get_source("c4", tmp_path, "test")


def test_mixtures_and_held_out_parts_pickle_for_worker_processes(two_sources):
    import pickle

    for source in (MixtureSource(two_sources, [0.7, 0.3]), HoldoutSource(two_sources[0], 0.1, "train")):
        copy = pickle.loads(pickle.dumps(source))
        assert list(islice(copy.read(), 50)) == list(islice(source.read(), 50))

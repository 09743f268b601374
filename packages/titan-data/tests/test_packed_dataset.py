import json
from itertools import islice

import pytest
import torch

from titan_data import DataError, PackedTokenDataset, TokenLoader, build_tokenizer, get_source
from titan_data.datasets.sources import ASSETS

TOKENIZER = build_tokenizer(ASSETS / "tokenizer")


def _loader(rank=0, world=1, streams=0, batch=4, seq_len=64, infinite=True, source=None):
    dataset = PackedTokenDataset(
        source or get_source("c4_test"), TOKENIZER, seq_len, dp_rank=rank, dp_world_size=world,
        num_streams=streams, infinite=infinite,
    )  # fmt: skip
    return TokenLoader(dataset, batch)


def test_windows_are_seq_len_shifted_pairs():
    inputs, labels = next(iter(_loader(seq_len=32)))
    assert inputs.shape == labels.shape == (4, 32)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_documents_are_framed_by_bos_and_eos():
    inputs, _ = next(iter(_loader(seq_len=256, batch=8)))
    assert inputs[0, 0].item() == TOKENIZER.bos_id
    ends = (inputs[:, :-1] == TOKENIZER.eos_id).nonzero().tolist()
    assert ends and all(inputs[row, col + 1].item() == TOKENIZER.bos_id for row, col in ends)


def _documents_read(world, tmp_path):
    """Texts each rank tokenises in one epoch, found by giving every document a unique marker."""
    docs = [{"text": f"doc{i} " + "word " * (i % 7 + 1)} for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs))
    from titan_data.datasets.sources import TextSource, read_jsonl_text

    shares = []
    for rank in range(world):
        seen = []

        class Recording:
            def encode(self, text, bos=False, eos=False):
                seen.append(text)
                return TOKENIZER.encode(text, bos=bos, eos=eos)

            bos_id, eos_id, vocab_size = TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.vocab_size

        ds = PackedTokenDataset(TextSource("t", path, read_jsonl_text), Recording(), 8, dp_rank=rank, dp_world_size=world, infinite=False)
        list(ds)
        shares.append(seen)
    return docs, shares


def test_four_ranks_read_disjoint_shares_that_cover_the_epoch(tmp_path):
    docs, shares = _documents_read(4, tmp_path)
    sets = [set(s) for s in shares]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not sets[i] & sets[j]
    assert set().union(*sets) == {d["text"] for d in docs}


def test_global_batch_is_the_same_set_of_windows_at_any_world_size():
    one = next(iter(_loader(world=1, streams=2, batch=8)))[0]
    halves = [next(iter(_loader(rank=r, world=2, streams=2, batch=4)))[0] for r in range(2)]
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, torch.cat(halves).tolist()))


def test_resume_continues_exactly_where_the_state_was_taken():
    loader = _loader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = [b[0] for b in islice(it, 3)]
    resumed = _loader()
    resumed.load_state_dict(state)
    got = [b[0] for b in islice(iter(resumed), 3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_state_saved_on_one_rank_is_dealt_to_two():
    loader = _loader(streams=2, batch=8)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = next(it)[0]
    parts = []
    for rank in range(2):
        part = _loader(rank=rank, world=2, streams=2, batch=4)
        part.load_state_dict(state)
        parts.append(next(iter(part))[0])
    assert sorted(map(tuple, expected.tolist())) == sorted(map(tuple, torch.cat(parts).tolist()))


def test_empty_dataset_is_a_clear_error(tmp_path):
    from titan_data.datasets.sources import TextSource, read_jsonl_text

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="holds no documents"):
        next(iter(_loader(source=TextSource("empty", empty, read_jsonl_text))))


def test_unknown_dataset_names_the_registered_ones():
    with pytest.raises(DataError, match="unknown dataset 'c5'; registered: c4_test"):
        get_source("c5")


def test_more_ranks_than_streams_is_refused():
    with pytest.raises(DataError, match="num_streams \\(2\\) is smaller than the data-parallel degree \\(4\\)"):
        _loader(rank=0, world=4, streams=2)

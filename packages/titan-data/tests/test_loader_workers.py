"""Loader worker processes: the batches and the saved state of one process, and exact resume mid-round."""

import multiprocessing

import pytest
import torch

from titan_data import DataError, PackedTokenDataset, StreamLayout, TokenLoader, get_source
from titan_data.loader import worker_streams

SEQ, BATCH = 32, 3  # 3 windows per batch over 4 streams: batch boundaries fall mid-round


def _loader(tokenizer, streams=4, **kwargs):
    dataset = PackedTokenDataset(
        get_source("c4_test"), tokenizer, SEQ, streams=StreamLayout(num_streams=streams)
    )
    return TokenLoader(dataset, BATCH, **kwargs)


def _take(loader, n):
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(n)]
    return batches, loader.state_dict(), iterator


def test_streams_are_shared_so_workers_in_turn_read_them_in_one_process_order():
    owned = [1, 3, 5, 7]
    assert [worker_streams(owned, w, 2) for w in range(2)] == [[1, 5], [3, 7]]
    assert [worker_streams(owned, w, 3) for w in range(3)] == [[1, 5], [3, 7], []]  # 2 divides 4, 3 not
    assert [worker_streams(owned, w, 2, position=5) for w in range(2)] == [[3, 7], [1, 5]]  # stream 3 next
    assert worker_streams([0], 1, 2) == []


@pytest.mark.slow
@pytest.mark.parametrize("streams", [4, 1])
def test_two_workers_give_the_batches_and_state_of_one_process_and_resume_exactly(llama3_tokenizer, streams):
    expected, _, _ = _take(_loader(llama3_tokenizer, streams), 7)
    workers = _loader(llama3_tokenizer, streams, num_workers=2, persistent_workers=True, prefetch_factor=4)
    got, state, iterator = _take(workers, 5)
    for (a, b), (c, d) in zip(got, expected[:5], strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    # Workers run ahead, yet the state is that of the 15 windows handed out: resume from it.
    resumed = _loader(llama3_tokenizer, streams, num_workers=2)
    resumed.load_state_dict(state)
    rest, _, _ = _take(resumed, 2)
    for (a, b), (c, d) in zip(rest, expected[5:], strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    # The saved state is the one-process loader's: it resumes without workers too.
    in_process = _loader(llama3_tokenizer, streams)
    in_process.load_state_dict(state)
    assert torch.equal(next(iter(in_process))[0], expected[5][0])
    del iterator


def test_close_stops_the_worker_processes_persistent_ones_too(llama3_tokenizer):
    loader = _loader(llama3_tokenizer, num_workers=2, persistent_workers=True)
    _, _, iterator = _take(loader, 1)  # a training loop still holds its iterator when the run closes
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    assert multiprocessing.active_children() == []
    _take(loader, 1)  # a later iteration starts new workers
    loader.close()
    assert multiprocessing.active_children() == []
    del iterator


def test_pin_memory_without_an_accelerator_is_refused(llama3_tokenizer):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pin_memory applies")
    with pytest.raises(DataError, match="pin_memory page-locks batches"):
        _loader(llama3_tokenizer, pin_memory=True)


def test_worker_settings_without_workers_are_refused(llama3_tokenizer):
    with pytest.raises(DataError, match="set num_workers > 0"):
        _loader(llama3_tokenizer, prefetch_factor=2)

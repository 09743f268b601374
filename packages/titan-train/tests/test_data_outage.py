"""A data source that stays down in the middle of a step: the checkpoint holds the loader's position as
the last completed step ended, so a resumed run takes exactly the batches an undisturbed run takes next."""

from itertools import islice

import pytest
import torch

from titan_ckpt import Checkpointer
from titan_data import IterableSource, PackedTokenDataset, SourceUnavailable, TokenLoader, build_tokenizer
from titan_data.datasets.registry import ASSETS
from titan_train.faults.data_outage import DataUnavailable, stop_on_data_outage

SEQ, BATCH = 16, 4  # 17-token windows, 68 tokens a batch


def _documents(tokenizer) -> list[str]:
    """A first document of 6 windows and a bit (102 to 118 tokens), so that step 2 takes two windows from
    it and then needs the second document: the outage then strikes mid-batch."""
    words = 1
    while len(tokenizer.encode("the " * words, bos=True, eos=True)) < 6 * (SEQ + 1) + 3:
        words += 1
    first = "the " * words
    assert 6 * (SEQ + 1) <= len(tokenizer.encode(first, bos=True, eos=True)) < 7 * (SEQ + 1)
    return [first] + [f"document {i} about rivers and hills and the sea" * 3 for i in range(40)]


def _loader(texts: list[str], tokenizer, down_after: int | None = None) -> TokenLoader:
    def read():
        for i, text in enumerate(texts):
            if down_after is not None and i >= down_after:
                raise SourceUnavailable("dataset: the test source stopped answering")
            yield text

    return TokenLoader(PackedTokenDataset(IterableSource("outage", read), tokenizer, SEQ), batch_size=BATCH)


def test_an_outage_mid_step_saves_the_position_the_last_completed_step_ended_at(tmp_path):
    tokenizer = build_tokenizer(ASSETS / "tokenizer")
    texts = _documents(tokenizer)
    reference = list(islice(_loader(texts, tokenizer), 4))

    loader = _loader(texts, tokenizer, down_after=1)
    checkpointer = Checkpointer(tmp_path, {"dataloader": loader})
    batches = iter(loader)
    with stop_on_data_outage(0, checkpointer, loader):
        first = next(batches)  # step 1 comes from the first document alone
    with pytest.raises(DataUnavailable, match=r"stopped answering; finished step 1 and saved .*step-1"):
        with stop_on_data_outage(1, checkpointer, loader):
            next(batches)  # step 2: two windows taken, then the source is gone
    assert torch.equal(first[0], reference[0][0])

    resumed = _loader(texts, tokenizer)
    Checkpointer(tmp_path, {"dataloader": resumed}).load()
    for got, want in zip(islice(resumed, 3), reference[1:], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

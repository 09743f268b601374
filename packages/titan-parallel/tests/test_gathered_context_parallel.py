"""How context parallelism over packed documents deals each row to the ranks (`dealing_order`).

The attention work of a query is the number of keys its mask lets it see: under a block-causal mask,
its position within its document plus one. The tests count that work per rank from the document ids
alone (no flex attention, no torch balancer), for the order each balancer deals.
"""

import pytest
import torch

from titan_parallel import ParallelConfigError, ptrr_block_size
from titan_parallel.gathered_context_parallel import dealing_order


def _documents(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def _work_per_rank(order: torch.Tensor, documents: torch.Tensor, cp: int) -> list[int]:
    """Keys seen by each rank's queries: a query at position p of a document starting at s sees p - s + 1."""
    doc = documents[0]
    starts = {int(d): int((doc == d).nonzero()[0]) for d in doc.unique()}
    work = torch.tensor([p - starts[int(doc[p])] + 1 for p in range(doc.numel())])
    return [int(work[chunk].sum()) for chunk in order[0].chunk(cp)]


@pytest.mark.parametrize("lengths", [[640, 128, 128, 64, 64], [256, 256, 512], [1024]])
def test_every_balancer_deals_each_position_to_exactly_one_rank(lengths):
    documents, cp = _documents(lengths), 2
    for balancer in (None, "headtail", "ptrr"):
        order = dealing_order(1, documents.shape[1], cp, balancer, documents, "cpu")
        assert sorted(order[0].tolist()) == list(range(documents.shape[1])), balancer


def test_ptrr_balances_documents_of_mixed_lengths_better_than_headtail():
    """One long document then short ones (packed chat rows): head-tail's chunks i and 2cp-1-i balance one
    causal sequence, not this; ptrr weighs each 128-block by its work under the mask and deals them in a
    snake, so the busiest rank does less. Planted: ptrr dealing blocks in plain order (rank r the r-th
    quarter of blocks) makes the busiest rank do more than head-tail's."""
    documents, cp = _documents([1536, 128, 128, 128, 64, 64]), 4
    seq = documents.shape[1]
    head_tail = _work_per_rank(dealing_order(1, seq, cp, "headtail", documents, "cpu"), documents, cp)
    ptrr = _work_per_rank(dealing_order(1, seq, cp, "ptrr", documents, "cpu"), documents, cp)
    assert sum(ptrr) == sum(head_tail)
    assert max(ptrr) < max(head_tail)
    assert max(ptrr) / (sum(ptrr) / cp) < 1.1  # within 10% of a perfect split


def test_headtail_gives_rank_i_chunks_i_and_its_mirror():
    order = dealing_order(1, 16, 2, "headtail", None, "cpu")[0]
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def test_ptrr_block_is_flex_attentions_128_where_it_tiles_and_a_smaller_power_of_two_elsewhere():
    assert ptrr_block_size(2048, 4) == 128
    assert ptrr_block_size(128, 2) == 64
    assert ptrr_block_size(96, 2) == 16
    assert ptrr_block_size(63, 2) is None


def test_a_row_the_ranks_cannot_split_evenly_is_refused_in_one_line():
    with pytest.raises(ParallelConfigError, match="multiple of 4"):
        dealing_order(1, 66, 2, "headtail", None, "cpu")
    with pytest.raises(ParallelConfigError, match="multiple of 2"):
        dealing_order(1, 63, 2, "ptrr", None, "cpu")

"""The pure helpers of bench/parity_torchtitan.py (the benchmark itself installs torchtitan, so it is
not a test): the document reordering that gives Titan's data-parallel ranks torchtitan's shards, and
the shim list the table prints."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _parity():
    spec = importlib.util.spec_from_file_location(
        "parity_torchtitan", REPO / "bench" / "parity_torchtitan.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleaving_gives_each_round_robin_rank_a_contiguous_block_of_documents():
    parity = _parity()
    docs = [f"d{i}" for i in range(12)]
    for parts in (2, 3):
        dealt = parity.interleave_contiguous_parts(docs, parts)
        size = len(docs) // parts
        for rank in range(parts):
            # Titan deals document i to rank i % parts; torchtitan gives rank r block r.
            assert dealt[rank::parts] == docs[rank * size : (rank + 1) * size]
    with pytest.raises(ValueError, match="do not split into 5 equal parts"):
        parity.interleave_contiguous_parts(docs, 5)


def test_the_printed_shims_are_the_launchers_shim_functions_with_their_first_sentence():
    parity = _parity()
    shims = dict(parity.shim_summaries())
    assert list(shims) == [
        "shim_device_is_cpu",
        "shim_cpu_memory_queries",
        "shim_fsdp_sum_reduction",
        "shim_barrier_device_ids",
        "shim_histc_integer_counts",
        "shim_moe_permute_indices_on_cpu",
        "shim_grad_norm_float64",
    ]
    assert shims["shim_barrier_device_ids"].startswith("torchtitan calls `barrier(device_ids=")
    assert parity.relative_difference(2.0, 2.0002) == pytest.approx(1e-4)

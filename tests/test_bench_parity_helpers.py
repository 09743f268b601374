"""The pure helpers of bench/parity_torchtitan.py (the benchmark itself installs torchtitan, so it is
not a test): the document reordering that gives Titan's data-parallel ranks torchtitan's shards, and
the shim list the table prints."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _parity():
    spec = importlib.util.spec_from_file_location(
        "parity_torchtitan", REPO / "bench" / "parity_torchtitan.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
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
        "shim_flex_attention_dense_on_cpu",
        "shim_block_masks_on_cpu",
        "shim_router_gate_bias_initialised",
        "shim_gpt_oss_blocks_in_float32",
    ]
    assert shims["shim_barrier_device_ids"].startswith("torchtitan calls `barrier(device_ids=")
    assert parity.relative_difference(2.0, 2.0002) == pytest.approx(1e-4)


def test_the_first_routing_difference_is_the_first_step_whose_per_expert_counts_differ():
    parity = _parity()
    # torchtitan's launcher writes a list of layers, Titan's metrics.jsonl a dict by layer name.
    theirs = [
        {"step": 1, "expert_counts": [[3, 1], [2, 2]]},
        {"step": 2, "expert_counts": [[2, 2], [4, 0]]},
        {"step": 3, "expert_counts": [[1, 3], [4, 0]]},
    ]
    ours = [
        {"step": 1, "expert_counts": {"layers.0.moe": [3.0, 1.0], "layers.1.moe": [2.0, 2.0]}},
        {"step": 2, "expert_counts": {"layers.0.moe": [2.0, 2.0], "layers.1.moe": [3.0, 1.0]}},
        {"step": 3, "expert_counts": {"layers.0.moe": [1.0, 3.0], "layers.1.moe": [4.0, 0.0]}},
    ]
    assert parity.first_routing_difference(theirs, ours) == 2
    assert parity.first_routing_difference(theirs, theirs) is None
    assert parity.first_routing_difference([{"step": 1}], [{"step": 1}]) is None  # no experts


def test_every_family_names_an_existing_torchtitan_config_of_its_model_and_known_layouts():
    parity = _parity()
    for name, family in parity.FAMILIES.items():
        assert family.toml.exists(), name
        assert set(family.layouts) <= set(parity.LAYOUTS), name
    assert "EP 2" in parity.FAMILIES["deepseek_v3"].layouts and "EP 2" in parity.FAMILIES["qwen3_moe"].layouts

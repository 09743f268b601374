"""Titan's llama3 flavors against torchtitan 0.2.2's own facts about them.

`tests/fixtures/torchtitan/` was written by `make_fixture.py` there, which runs torchtitan's trainer in a
separate environment (torchtitan 0.2.2, torch 2.11): facts.json holds torchtitan's parameter counts,
rotary settings and rotary table rows (its checkpoints there are loaded in
packages/titan-train/tests/test_torchtitan_checkpoints.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_models import Transformer, count_parameters, llama3_args
from titan_models.rope import rotary_frequencies

FIXTURE = Path(__file__).parent / "fixtures" / "torchtitan"
FACTS = json.loads((FIXTURE / "facts.json").read_text())


@pytest.mark.parametrize("flavor", ["debugmodel", "8B", "70B", "405B"])
def test_llama3_flavors_match_torchtitan_parameter_counts_and_rotary_settings(flavor):
    theirs = FACTS["flavors"][flavor]
    ours = llama3_args(flavor)
    with torch.device("meta"):
        assert count_parameters(Transformer(ours)) == theirs["n_params"]
    assert ours.rope_theta == theirs["rope_theta"]
    assert ours.norm_eps == theirs["norm_eps"]
    assert ours.context_len == theirs["max_seq_len"] == 131_072
    s = ours.rope_scaling
    assert {
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_seq_len": s.original_max_seq_len,
    } == theirs["rope_scaling"]
    if "rotary_rows" in theirs:
        table = rotary_frequencies(ours.head_dim, 8192, ours.rope_theta, ours.rope_scaling)
        for position, row in theirs["rotary_rows"].items():
            expected = torch.view_as_complex(torch.tensor(row, dtype=torch.float32))
            assert torch.equal(table[int(position)], expected), (flavor, position)

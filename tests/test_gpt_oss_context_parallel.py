"""gpt-oss attention under context parallelism 2 (two gloo ranks) equals one process and a direct softmax.

One torchrun launch (tests/workers/gpt_oss_cp_attention.py) runs a windowed (window 16) and a full
gpt-oss attention layer, every parameter random (sinks and biases included), at sequence lengths 12,
16, 20 and 64 (shorter than, equal to and past the window; at 64 the load-balanced chunks sit 48
positions apart) with load balancing, and at 64 with contiguous chunks, through
`titan_parallel.context_parallel_ctx` handing the model its `SequenceShard`. The outputs and the
gradients of the input and of every parameter (through q, k, v and the sinks) are compared with the same
layers in one process; the outputs also with a float64 softmax written in the worker, key by key.
Measured within 7.9e-7 relative (float32; 2026-11-27). Plants: the sink dropped under context
parallelism failed every case (outputs 0.53-0.84 off, the sinks' gradient wholly); query positions taken
as contiguous (rank * len + i) failed the load-balanced cases only (outputs 0.95-1.13 off), contiguous
chunks being right for them.
"""

import json
from pathlib import Path

import pytest

from titan_train.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "gpt_oss_cp_attention.py"
TOLERANCE = 1e-5  # relative to the largest magnitude; float32 kernels, float64 reference; measured <= 7.9e-7
CASES = ["seq12_balanced", "seq16_balanced", "seq20_balanced", "seq64_balanced", "seq64_contiguous"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpt_oss_cp") / "results.json"
    result = run_torchrun(str(WORKER), str(out), nproc=2, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_cp2_attention_with_sinks_and_window_equals_one_process(results, case):
    r = results[case]
    assert r["out_vs_one_process"] < TOLERANCE, r
    assert r["out_vs_direct"] < TOLERANCE, r
    assert r["x_grad_vs_one_process"] < TOLERANCE, r
    worst = max(r["param_grads_vs_one_process"].items(), key=lambda item: item[1])
    assert worst[1] < TOLERANCE, worst


def test_load_balanced_shards_hold_chunks_i_and_2cp_minus_1_minus_i(results):
    """The case the window must cross: rank 0 holds positions 0-15 and 48-63 of 64."""
    assert results["seq64_balanced"]["positions_rank0"] == [*range(16), *range(48, 64)]

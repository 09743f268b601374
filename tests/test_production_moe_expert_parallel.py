"""Titan's production MoE layer (`titan_models.moe.MoE`) under titan-parallel's expert parallelism computes the
unsharded layer: outputs and gradients.

titan-parallel's own EP tests use a toy MoE (the dependency rule keeps titan_models out of that package);
this cross-package test runs the real layer, with its router, expert bias, shared expert and token counts,
split ep 2 over 2 gloo ranks (tests/workers/production_moe_ep.py), for DeepSeek's routing (scores after the
experts, grouped, top 2) and Llama 4's (top 1 scaling the token before its expert). Each rank feeds its half
of a batch; the reference is the same randomised layer, unsharded, on the whole batch. Outputs, input
gradients and the rank's experts' gradients must equal the reference's, the replicated router's and shared
expert's gradients summed over the ranks to 2e-5 (summation order), and the token counts summed over the
ranks exactly. Measured 2026-11-27: outputs, input and expert gradients equal bit for bit, others within
3.9e-6 (139 s on the shared 2-core machine at load 16-20, most of it imports). A gradient scaled by 1.5 in
the experts' dispatch (forward unchanged) failed both routings (Llama 4's by 1.27).
"""

import json
from pathlib import Path

import pytest

from titan_train.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "production_moe_ep.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("production_moe_ep") / "results.json"
    run = run_torchrun(str(WORKER), str(out), nproc=2, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("routing", ["deepseek", "llama4"])
def test_expert_parallel_moe_layer_computes_the_unsharded_layer_and_its_gradients(results, routing):
    diffs = dict(results[routing])
    assert diffs.pop("local experts") == 2  # 4 experts split over ep 2
    assert diffs.pop("scale") > 1.0
    assert diffs.pop("tokens per expert") == 0
    for name in ("output", "input grad", "grad moe.experts.w1", "grad moe.experts.w2", "grad moe.experts.w3"):
        assert diffs.pop(name) <= 1e-6, name
    assert set(diffs) == {
        "grad moe.router.gate.weight",
        *(f"grad moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")),
    }
    assert max(diffs.values()) <= 2e-5, diffs

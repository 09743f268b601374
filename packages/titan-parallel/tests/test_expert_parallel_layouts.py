"""Expert-parallel layouts train like one process: one 4-rank torchrun launch of the toy MoE.

Each layout trains 4 steps beside an unparallelized copy on the full batch (float32, SGD):
losses and gradient norms must agree to 1e-5 relative at every step, the tokens-per-expert summed
over the data ranks (which move the expert bias) exactly, and every weight after the run to 2e-5 of its tensor's
largest value. Facts recorded in the run show the experts really are split as the layout says.

The MoE here is a toy (workers/toy_moe.py): titan-parallel may not import titan_models (the dependency
rule, tests/test_dependency_rule.py). The production MoE layer (`titan_models.moe.MoE`, its router,
grouped experts, shared experts and token counts) runs under this package's expert parallelism in two
cross-package tests: tests/test_production_moe_expert_parallel.py compares the layer at ep 2 with the
unsharded layer (outputs and gradients, DeepSeek's and Llama 4's routing), and the layout matrix,
tests/test_train_layouts.py, trains it: Qwen3-MoE cut to 2 layers of 8 experts trains
under `moe_ep2`, `moe_ep2_fsdp`, `moe_ep4_borrowing_tp`, `moe_ep2_etp2_tp2`, `moe_ep2_cp2` and
`moe_ep2_pp2`, and DeepSeek-V3 with a shared expert under `shared_ep2_tp2`, each against one process by
loss and grad_norm at every step and by its final weights (a gradient scaled by 1.5 in the dispatch or
the combine made `moe_ep2` fail; see that module's docstring).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "moe_layouts.py"

LAYOUTS = {
    "ep2_fsdp4": {"mesh_sizes": {"ep": 2, "efsdp": 2, "etp": None}, "w1_local_shape": [1, 32, 32]},
    "ep4": {"mesh_sizes": {"ep": 4, "efsdp": 1, "etp": None}, "w1_local_shape": [1, 32, 32]},
    "ep2_etp2": {
        "mesh_sizes": {"ep": 2, "efsdp": 1, "etp": 2},
        "w1_mesh_dims": ["efsdp", "ep", "etp"],
        "w1_local_shape": [2, 16, 32],
    },
    "ep4_borrowing_tp": {"mesh_sizes": {"ep": 4, "efsdp": 1, "etp": None}, "w1_local_shape": [1, 32, 32]},
    "tp2_experts": {"w1_placements": ["S(0)", "S(1)"], "w1_local_shape": [2, 16, 32]},
    "hsdp_ep2": {"w1_mesh_dims": ["dp_replicate", "efsdp", "ep"], "w1_local_shape": [2, 32, 32]},
    "ep2_cp2": {"mesh_sizes": {"ep": 2, "efsdp": 2, "etp": None}, "w1_local_shape": [1, 32, 32]},
    "ep2_pp2": {"mesh_sizes": {"ep": 2, "efsdp": 1, "etp": None}, "w1_local_shape": [2, 32, 32]},
    # Per-op checkpointing. The experts' FSDP unit is on one rank (efsdp 1), so no all-gather can offset the
    # extra profiler mark its hooks add in the recompute: the layout where torch's per-op indexing broke.
    "hsdp_ep2_ac_op": {"w1_mesh_dims": ["dp_replicate", "efsdp", "ep"], "w1_local_shape": [2, 32, 32]},
    "ep2_ac_full_compile": {"mesh_sizes": {"ep": 2, "efsdp": 2, "etp": None}, "compiled_router": True},
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, request, cases_to_launch):
    out = tmp_path_factory.mktemp("moe") / "four.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(out),
        *cases_to_launch(request.module, "four_ranks", [*LAYOUTS, "dcp_reshard", "refusals"]),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


# Seen on torch 2.11 (the floor run), not on 2.15: ep2 + pp2 drifts from one process by 1.6e-4 relative in loss,
# and the compiled MoE block recompiles past dynamo's limit. Expert parallelism is claimed for torch >= 2.15
# (marked beyond_floor by conftest.py).
BEYOND_THE_FLOOR = {"ep2_pp2", "ep2_ac_full_compile"}
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUTS)
def test_expert_parallel_layout_trains_like_one_process(four_ranks, case):
    if case in BEYOND_THE_FLOOR and _TORCH < (2, 15):
        pytest.skip(f"{case} is claimed for torch >= 2.15 (on {torch.__version__}: see BEYOND_THE_FLOOR)")
    result = four_ranks[case]
    assert "error" not in result, result.get("error")
    ref, par = result["reference"], result["parallel"]
    assert par["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert par["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert result["tokens_per_expert_as_one_process"]
    assert result["weight_diff"] < 2e-5
    assert len(set(ref["losses"])) == len(ref["losses"])  # training moved
    assert max(ref["grad_norms"]) > 0.3  # above the clipping threshold: clipping is exercised
    assert {k: result["facts"][k] for k in LAYOUTS[case]} == LAYOUTS[case]


@pytest.mark.slow
def test_per_op_checkpointing_keeps_the_all_to_alls_instead_of_rerunning_them(four_ranks):
    # Each MoE forward runs 3 (token counts, dispatch, combine), each backward 2; a recompute that reran
    # the forward's would add 3 per checkpointed MoE layer.
    counts = {
        case: four_ranks[case]["facts"]["all_to_all_per_step"] for case in ("hsdp_ep2", "hsdp_ep2_ac_op")
    }
    assert counts == {"hsdp_ep2": 5, "hsdp_ep2_ac_op": 5}


@pytest.mark.slow
def test_experts_saved_at_ep2_load_at_ep4_and_ep1_unchanged(four_ranks):
    result = four_ranks["dcp_reshard"]
    assert "error" not in result, result.get("error")
    assert result["facts"] == {
        "ep4": ["(_StridedShard(dim=0, sf=4), Shard(dim=0))", True],
        "ep1": ["(Shard(dim=0),)", True],
    }


@pytest.mark.slow
def test_expert_layouts_the_model_cannot_take_are_refused_with_the_reason(four_ranks):
    result = four_ranks["refusals"]
    assert "error" not in result, result.get("error")
    assert "expert_parallel_degree(4) does not divide the model's num_experts (6)" in result["facts"]["plain"]

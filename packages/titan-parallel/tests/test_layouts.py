"""Every layout trains like one process: 5 steps of losses and gradient norms on real gloo groups.

Two torchrun launches (2 and 4 ranks) each run many layouts of the toy transformer, a model
written with torch.nn in this test folder and parallelized through titan-parallel's public API
alone; each layout is compared with an unparallelized copy trained on the full batch, in float32,
to 1e-4 relative. Per layout, facts recorded in the run show the layout really took effect.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_parallel.mx import mx_available

WORKER = Path(__file__).parent / "workers" / "layouts.py"
REL = 1e-4

TWO_RANKS = {
    "fsdp": {"block_param_sharded_after_forward": True, "wq_local_shape": [16, 32], "fsdp_module": True},
    "fsdp_reshard_always": {"block_param_sharded_after_forward": True},
    "fsdp_reshard_never": {"block_param_sharded_after_forward": False},
    "fsdp_bf16_params": {"logits_dtype": "torch.bfloat16"},
    "fsdp_cpu_offload": {"offload_policy": "CPUOffloadPolicy"},
    "ddp": {"wq_placements": ["R"], "wq_local_shape": [32, 32]},
    "tp_sp_loss_parallel": {"wq_placements": ["S(0)"], "wq_local_shape": [16, 32], "fsdp_module": False},
    "tp_plain": {"wq_placements": ["S(0)"], "wq_local_shape": [16, 32]},
    # A tied embedding and output head stay one parameter, vocabulary-sharded.
    "tp_tied": {"tied": True, "wq_placements": ["S(0)"]},
    "cp_allgather": {"local_seq_len": 8, "holds_sequence_head": False},
    "cp_no_load_balance": {"local_seq_len": 8, "holds_sequence_head": True},
    "cp_alltoall": {"local_seq_len": 8},
    "pp_1F1B": {"stage_blocks": [["0", "1"]]},
    "pp_GPipe": {"stage_blocks": [["0", "1"]]},
    "pp_Interleaved1F1B": {"stage_blocks": [["0"], ["3"]]},
    "pp_LoopedBFS": {"stage_blocks": [["0"], ["3"]]},
    "pp_InterleavedZeroBubble": {"stage_blocks": [["0"], ["3"]]},
    "pp_ZBVZeroBubble": {"stage_blocks": [["0"], []]},
    "pp_DualPipeV": {"stage_blocks": [["0"], []], "schedule": "ScheduleDualPipeV"},
    "pp_split_points_microbatch_2": {"stage_blocks": [["0"]]},
    "float8_tensorwise_fsdp_all_gather": {
        "linear_types": ["Float8Linear", "Linear"],
        "wq_local_type": "WeightWithDynamicFloat8CastTensor",
    },
    "float8_rowwise_fsdp": {"linear_types": ["Float8Linear", "Linear"], "wq_local_type": "Tensor"},
    # float8 under TP: tensorwise through torchao's float8 styles (float8 all-gathers), rowwise through plain ones
    "float8_tensorwise_tp": {"linear_types": ["Float8Linear", "Linear"], "wq_placements": ["S(0)"]},
    "float8_rowwise_tp": {"linear_types": ["Float8Linear", "Linear"], "wq_placements": ["S(0)"]},
    "mx_emulated_fsdp": {"linear_types": ["Linear", "MXLinear"], "fsdp_module": True},
}
FOUR_RANKS = {
    "hsdp": {"wq_placements": ["R", "S(0)"], "fsdp_mesh_ndim": 2, "wq_local_shape": [16, 32]},
    "fsdp_tp": {"wq_local_shape": [8, 32], "fsdp_mesh_ndim": 1},
    "fsdp_tp_tied": {"tied": True, "wq_local_shape": [8, 32], "fsdp_module": True},
    "fsdp_cp": {"local_seq_len": 8, "wq_local_shape": [8, 32], "fsdp_mesh_ndim": 1},
    "hsdp_cp": {"local_seq_len": 8, "wq_placements": ["R", "S(0)"], "fsdp_mesh_ndim": 2},
    "pp_fsdp": {"stage_blocks": [["0"], ["3"]], "fsdp_module": True, "wq_local_shape": [16, 32]},
    "pp_tp": {"stage_blocks": [["0", "1"]], "wq_placements": ["S(0)"], "wq_local_shape": [16, 32]},
}
# bfloat16 parameters round every matmul input; the rest is float32.
# Rowwise float8 under TP: measured up to 5.4e-4 from rowwise float8 in one process (grad_norm).
TOLERANCE = {"fsdp_bf16_params": 2e-2, "float8_rowwise_tp": 2e-3}
# Skipped on the floor (torch 2.11 refuses float8 rowwise on CPU; torchao 0.17 has no MXFP8 training): under
# .ci/run these run in the main suite, on the locked torch, and the floor check runs the others.
BEYOND_THE_FLOOR = {"float8_rowwise_fsdp", "float8_rowwise_tp", "mx_emulated_fsdp"}  # marked by conftest.py


def _launch(world: int, cases: list[str], out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(out),
        *cases,
    ]
    # oneDNN may pick AMX bf16 kernels a VM cannot execute (SIGILL); cap the ISA it may use.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, request, cases_to_launch):
    cases = cases_to_launch(request.module, "two_ranks", [*TWO_RANKS, "refusals", "cp_failed_step"])
    return _launch(2, cases, tmp_path_factory.mktemp("layouts") / "two.json")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, request, cases_to_launch):
    cases = cases_to_launch(request.module, "four_ranks", list(FOUR_RANKS))
    return _launch(4, cases, tmp_path_factory.mktemp("layouts") / "four.json")


def _check(result: dict, case: str, expected_facts: dict) -> None:
    assert "error" not in result, result.get("error")
    rel = TOLERANCE.get(case, REL)
    ref, par = result["reference"], result["parallel"]
    assert par["losses"] == pytest.approx(ref["losses"], rel=rel)
    assert par["grad_norms"] == pytest.approx(ref["grad_norms"], rel=rel)
    # Training moved: the comparison is over 5 different steps, not one repeated state.
    assert len(set(ref["losses"])) == len(ref["losses"])
    assert max(ref["grad_norms"]) > 0.3  # above the clipping threshold: clipping is exercised
    assert {k: result["facts"][k] for k in expected_facts} == expected_facts


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_RANKS)
def test_two_rank_layout_trains_like_one_process(two_ranks, case, skip_unless_cpu_runs_float8):
    if case.startswith("float8_"):
        skip_unless_cpu_runs_float8(case.split("_")[1])
    if case.startswith("mx_") and not mx_available():
        pytest.skip("MXFP8 training needs torchao >= 0.18 (the floor run has 0.17)")
    _check(two_ranks[case], case, TWO_RANKS[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR_RANKS))
def test_four_rank_layout_trains_like_one_process(four_ranks, case):
    _check(four_ranks[case], case, FOUR_RANKS[case])


@pytest.mark.slow
def test_mesh_views_name_each_use(four_ranks):
    sizes = {case: four_ranks[case]["facts"]["mesh_sizes"] for case in ("hsdp", "fsdp_cp", "pp_tp")}
    # data loading (dp), parameter sharding (dp_shard_cp / fsdp), loss averaging (dp_cp)
    assert sizes["hsdp"] == {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4, "fsdp": 4, "tp": None, "pp": None}
    assert sizes["fsdp_cp"] == {"dp": 2, "dp_shard_cp": 4, "dp_cp": 4, "fsdp": 4, "tp": None, "pp": None}
    assert sizes["pp_tp"] == {"dp": None, "dp_shard_cp": None, "dp_cp": None, "fsdp": None, "tp": 2, "pp": 2}


@pytest.mark.slow
def test_a_step_that_fails_under_context_parallel_leaves_sdpa_buffers_and_shards_restored(two_ranks):
    result = two_ranks["cp_failed_step"]
    assert "error" not in result, result.get("error")
    # Rank 0 of 2, load-balanced: chunks 0 and 3 of 4 (rank 1 holds 2..5); a self-attending part's shard says so.
    assert result["facts"] == {
        "sdpa_restored": True,
        "buffer_restored": True,
        "shard_withdrawn": True,
        "positions": [0, 1, 6, 7],
        "all_positions": [0, 1, 6, 7, 2, 3, 4, 5],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("refusal", "message"),
    [
        (
            "async_tp_on_cpu",
            r"UnsupportedDeviceError: .*async_tp needs CUDA and compiled blocks \(device 'cpu'",
        ),
        ("pipeline_without_pp", "build_pipeline needs pp > 1"),
        ("cp_without_buffers", r"cp\(2\) > 1 but no cp_buffers were given"),
        ("cp_seq_not_divisible", r"sequence length 6 on dim 1, not divisible by 4, the number of chunks"),
        (
            "cp_alltoall_with_own_attention",
            r"OwnAttention gathers the whole sequence's keys .* use rotate_method='allgather'",
        ),
        ("cpu_offload_without_sharding", "cpu_offload needs sharded parameters"),
    ],
)
def test_layouts_that_cannot_run_are_refused_with_the_reason(two_ranks, refusal, message):
    assert "error" not in two_ranks["refusals"], two_ranks["refusals"].get("error")
    got = two_ranks["refusals"]["facts"][refusal]
    assert got is not None, f"{refusal} was accepted"
    assert re.search(message, got), got

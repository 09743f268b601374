"""Every family's own tensor-parallel plan, and FSDP of tied embeddings, on 2 real gloo ranks (one launch
of `workers/tp_worker.py` for all families)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_models import ModelArgs, ModelConfigError, Transformer

WORKER = Path(__file__).parent / "workers" / "tp_worker.py"


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp_sp_lp", "tp_sp", "tp_plain", "tp_block_causal"])
def test_tp_plan_forward_and_backward_equal_one_process(two_rank_results, case):
    r = two_rank_results[case]
    assert r["init"] == 0.0  # initialisation does not depend on the layout
    assert r["logits"] < 1e-5 and r["loss"] < 1e-5 and r["grads"] < 1e-5
    # Every linear layer (and under sequence parallelism every norm) holds a shard.
    assert r["sharded_params"] == (21 if case != "tp_plain" else 16)
    assert r["logits_is_dtensor"] == (case in ("tp_sp_lp", "tp_block_causal"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "deepseek_sp_lp",
        "deepseek_low_rank_q_yarn_block_causal",
        "deepseek_plain",
        "qwen3_moe_sp_lp",
        "qwen3_dense_plain",
        "qwen3_dense_tied_sp_lp",
        "llama4_irope_sp",
        "llama4_irope_plain",
    ],
)
def test_moe_family_tp_plans_forward_and_backward_equal_one_process(two_rank_results, case):
    """DeepSeek-V3 (latent attention, replicated latents), Qwen3 (QK norms split by head) and Llama 4
    (iRoPE, chunked attention), with their MoE layers split as their routing allows (Llama 4: shared experts split over tp)."""
    r = two_rank_results[case]
    assert r["sharded_heads"], case
    assert r["init"] == 0.0  # initial weights do not depend on the layout
    assert r["logits"] < 1e-5 and r["loss"] < 1e-5, r
    # DeepSeek: without SumGradients the shared rotary key's weights are off by ~2e-5.
    assert r["grads"] < (1e-6 if case.startswith("deepseek") else 1e-5), (r["worst_grad"], r["grads"])
    if case == "deepseek_sp_lp":
        assert r["all_dtensor"]


@pytest.mark.slow
def test_fsdp_keeps_tied_embeddings_tied_and_trains_like_one_process(two_rank_results):
    r = two_rank_results["fsdp_tied"]
    assert r["tied"] and r["n_params"] == r["n_ref_params"]
    assert r["init"] == 0.0 and r["loss"] < 1e-5 and r["params"] < 1e-5


def test_tp_plan_names_every_module_of_a_block():
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=32))
    names = {n for n, _ in model.named_modules()}
    for sequence_parallel in (True, False):
        plan = model.tp_plan(sequence_parallel=sequence_parallel)
        for key in plan:
            assert key.replace("*", "0") in names, key
        norms = {"norm", "layers.*.attention_norm", "layers.*.ffn_norm"}
        assert norms <= set(plan) if sequence_parallel else not norms & set(plan)


def test_tied_embeddings_refuse_pipeline_parallelism_with_a_reason():
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, tie_word_embeddings=True))
    with pytest.raises(ModelConfigError, match="tie_word_embeddings=False"):
        model.pipeline_units()

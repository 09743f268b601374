"""The MoE families' training FLOPs per token are torchtitan 0.2.2's, so tflops and MFU compare like for like.

The reference is torchtitan's `get_moe_model_nparams_and_flops` (torchtitan/models/utils.py at v0.2.2),
written out here: parameters sorted by name into embedding, router, shared experts, routed experts and
dense; active = router + shared + routed * top_k // num_experts; FLOPs = 6 * (dense - embedding + active)
+ 6 * layers * heads * head_dims * seq_len, with each family's head_dims from its `get_nparams_and_flops`
(DeepSeek: qk_nope + qk_rope + v head dims; Qwen3: 2 * head_dim; Llama 4: 2 * dim // heads). Titan's
models keep torchtitan's parameter names, so the same sort applies to them.
"""

from dataclasses import replace

import pytest
import torch

from titan_train.registry import get_model_family

SEQ_LEN = 8192
HEAD_DIMS = {
    "deepseek_v3": lambda a: a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim,
    "qwen3": lambda a: 2 * a.head_dim,
    "llama4": lambda a: 2 * (a.dim // a.n_heads),
}
FLAVORS = [
    ("deepseek_v3", "debugmodel"),
    ("deepseek_v3", "16B"),
    ("qwen3", "debugmodel_moe"),
    ("qwen3", "30B-A3B"),
    ("llama4", "debugmodel"),
    ("llama4", "17bx128e_irope"),
]


def torchtitan_moe_flops_per_token(args, model: torch.nn.Module, head_dims: int, seq_len: int) -> int:
    embedding = router = shared = experts = dense = 0
    for name, p in model.named_parameters():
        if "embedding" in name:
            embedding += p.numel()
            dense += p.numel()
        elif "moe.shared_experts" in name:
            shared += p.numel()
        elif "moe.router" in name:
            router += p.numel()
        elif "moe.experts" in name:
            experts += p.numel()
        else:
            dense += p.numel()
    m = args.moe_args
    active = router + shared + experts * m.top_k // m.num_experts
    return 6 * (dense - embedding + active) + 6 * args.n_layers * args.n_heads * head_dims * seq_len


@pytest.mark.parametrize(("family", "flavor"), FLAVORS)
def test_moe_flops_per_token_equal_torchtitan_s_formula(family, flavor):
    fam = get_model_family(family)
    args = replace(fam.args_for(flavor), eos_id=0)
    with torch.device("meta"):
        model = fam.build(args)
    want = torchtitan_moe_flops_per_token(args, model, HEAD_DIMS[family](args), SEQ_LEN)
    assert fam.flops_per_token(args, 0, 0, SEQ_LEN) == want


# torchtitan 0.2.2's own `get_nparams_and_flops` output, (nparams, FLOPs per token), for its model of each
# flavor after `update_from_config` at that seq_len, as its trainer logs them. Produced by
# `uv run python bench/flops_against_torchtitan.py` (torchtitan 0.2.2 in bench/.torchtitan-0.2.2-env; the
# table is in bench/RESULTS.md, 2026-11-27), which CI cannot run: torchtitan is not installed here.
TORCHTITAN_0_2_2 = {
    ("llama3", "8B", 8192): (8_030_261_248, 57_914_449_920),
    ("deepseek_v3", "16B", 4096): (15_706_484_224, 18_105_996_288),
    ("deepseek_v3", "671B", 4096): (671_026_404_352, 281_158_232_064),
    ("qwen3", "30B-A3B", 4096): (30_532_122_624, 27_914_883_072),
    ("llama4", "17bx16e", 8192): (107_769_861_120, 120_989_644_800),
    ("gpt_oss", "20b", 128): (20_914_757_184, 21_800_838_528),
    ("gpt_oss", "120b", 8192): (116_829_156_672, 45_292_611_456),
}
# Where Titan counts other FLOPs on purpose: gpt-oss's sliding-window layers (every other layer; window
# 128) attend to at most 128 keys, which Titan counts and torchtitan 0.2.2 does not (it counts every layer
# over the whole sequence). 120b: 12 * 64 heads * 64 head_dim * (8192 - 128) keys * 18 windowed layers.
FEWER_THAN_TORCHTITAN = {("gpt_oss", "120b", 8192): 12 * 64 * 64 * (8192 - 128) * 18}


@pytest.mark.parametrize(("family", "flavor", "seq_len"), list(TORCHTITAN_0_2_2))
def test_a_run_s_parameters_and_flops_are_torchtitan_0_2_2_s_own_output(family, flavor, seq_len):
    from titan_train.config import load_job_config
    from titan_train.plan import resolve

    config = load_job_config(
        ["--model.name", family, "--model.flavor", flavor, "--training.seq_len", str(seq_len)]
    )
    plan = resolve(config, 1, "cuda")
    nparams, flops = TORCHTITAN_0_2_2[(family, flavor, seq_len)]
    assert plan.params.total == nparams
    assert plan.flops_per_token == flops - FEWER_THAN_TORCHTITAN.get((family, flavor, seq_len), 0)

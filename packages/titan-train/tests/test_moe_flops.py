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

"""DeepSeek-V3 flavors with torchtitan 0.2.2's names and published shapes (DeepSeek-V2-Lite = "16B",
DeepSeek-V2 = "236B", DeepSeek-V3 = "671B"), and Moonshot's Kimi K2 ("kimi_k2", the shape of Kimi-K2-Base
and Kimi-K2-Instruct's config.json, which names DeepseekV3ForCausalLM) with a debug model of its structure."""

from __future__ import annotations

from dataclasses import replace

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.errors import ModelConfigError
from titan_models.moe import MoEArgs

# 163,840 = rope_factor 40 x original_seq_len 4096: the context YaRN is published for.
_CONTEXT = 163_840
_MLA = dict(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_FLEX_BLOCK_CAUSAL = dict(attn_backend="flex", attn_mask_type="block_causal")
_V2_ROUTING = dict(score_func="softmax", route_norm=False, score_before_experts=False)

_DEBUG = DeepSeekV3Args(
    vocab_size=2048,
    dim=256,
    inter_dim=1024,
    moe_inter_dim=256,
    n_layers=6,
    n_dense_layers=1,
    n_heads=16,
    moe_args=MoEArgs(num_experts=8, num_shared_experts=2, top_k=3, **_V2_ROUTING),
    mscale=0.70,
    context_len=_CONTEXT,
    **_MLA,
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": _DEBUG,
    "debugmodel_flex_attn": replace(_DEBUG, **_FLEX_BLOCK_CAUSAL),
    "16B": DeepSeekV3Args(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        moe_args=MoEArgs(num_experts=64, num_shared_experts=2, top_k=6, **_V2_ROUTING),
        mscale=0.70,
        context_len=_CONTEXT,
        **_MLA,
        **_FLEX_BLOCK_CAUSAL,
    ),
    "236B": DeepSeekV3Args(
        vocab_size=102400,
        dim=5120,
        inter_dim=12288,
        moe_inter_dim=1536,
        n_layers=60,
        n_dense_layers=1,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=160,
            num_shared_experts=2,
            top_k=6,
            num_expert_groups=8,
            num_limited_groups=3,
            route_scale=16.0,
            **_V2_ROUTING,
        ),
        context_len=_CONTEXT,
        **{**_MLA, "q_lora_rank": 1536},
        **_FLEX_BLOCK_CAUSAL,
    ),
    "671B": DeepSeekV3Args(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        moe_args=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            num_expert_groups=8,
            num_limited_groups=4,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            score_before_experts=False,
        ),
        context_len=_CONTEXT,
        **{**_MLA, "q_lora_rank": 1536},
        **_FLEX_BLOCK_CAUSAL,
    ),
}


# Kimi K2 as its config.json states it: MLA with a query latent, 64 heads, one dense block, 384 routed
# experts (8 a token, sigmoid scores normalised then scaled by 2.827, no expert groups) and one shared,
# rope theta 50000 stretched by YaRN (factor 32 over 4096 positions, beta_fast = beta_slow = 1, mscale 1),
# which Hugging Face applies at every length (yarn=True), norms at eps 1e-6.
_KIMI_K2_ROUTING = dict(score_func="sigmoid", route_norm=True, route_scale=2.827, score_before_experts=False)
_KIMI_K2_ROPE = dict(
    rope_theta=50000.0,
    rope_factor=32.0,
    original_seq_len=4096,
    beta_fast=1,
    beta_slow=1,
    mscale=1.0,
    yarn=True,
)
_KIMI_K2_EPS = dict(norm_eps=1e-6, latent_norm_eps=1e-6, final_norm_eps=1e-6)
DEEPSEEK_V3_FLAVORS["kimi_k2"] = DeepSeekV3Args(
    vocab_size=163840,
    dim=7168,
    inter_dim=18432,
    moe_inter_dim=2048,
    n_layers=61,
    n_dense_layers=1,
    n_heads=64,
    moe_args=MoEArgs(num_experts=384, num_shared_experts=1, top_k=8, **_KIMI_K2_ROUTING),
    context_len=131_072,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    **_KIMI_K2_ROPE,
    **_KIMI_K2_EPS,
    **_FLEX_BLOCK_CAUSAL,
)
# Kimi K2's structure (query latent, one dense block, sigmoid routing scaled by 2.827, one shared expert,
# its rope) at debug size.
DEEPSEEK_V3_FLAVORS["kimi_k2_debugmodel"] = DeepSeekV3Args(
    vocab_size=2048,
    dim=256,
    inter_dim=1024,
    moe_inter_dim=256,
    n_layers=4,
    n_dense_layers=1,
    n_heads=8,
    moe_args=MoEArgs(num_experts=16, num_shared_experts=1, top_k=4, **_KIMI_K2_ROUTING),
    context_len=131_072,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    **_KIMI_K2_ROPE,
    **_KIMI_K2_EPS,
)


def deepseek_v3_args(flavor: str, **overrides) -> DeepSeekV3Args:
    """The args of a named flavor, with overrides (e.g. `max_seq_len` for a run)."""
    if flavor not in DEEPSEEK_V3_FLAVORS:
        raise ModelConfigError(
            f"model: flavor '{flavor}' is not a deepseek_v3 flavor; choose one of {', '.join(DEEPSEEK_V3_FLAVORS)}"
        )
    return replace(DEEPSEEK_V3_FLAVORS[flavor], **overrides)

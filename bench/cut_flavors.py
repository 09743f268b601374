"""Published block shapes with only a few blocks: what one GPU can hold of a large model.

bench/memory_vs_gpu.py imports this through `--experimental.custom_import cut_flavors`, in the dry
run and in the training run alike, so both see the same flavors:
- llama3 `8B_4layers`: Llama 3.1 8B's blocks, 4 of them;
- deepseek_v3 `16B_4layers`: DeepSeek-V2-Lite's (1 dense block, 3 MoE blocks of 64 experts, top 6),
  with `_sdpa` its attention as SDPA causal instead of flex block-causal, and `_loop` its experts
  computed expert by expert instead of grouped matmuls;
- qwen3 `30B-A3B_4layers`: Qwen3-30B-A3B's MoE blocks (128 experts, top 8), 4 of them.
"""

from __future__ import annotations

from dataclasses import replace

from titan_train.registry import get_model_family, register_flavor

register_flavor("llama3", "8B_4layers", get_model_family("llama3").args_for("8B", n_layers=4))

_DSV3_16B = get_model_family("deepseek_v3").args_for("16B", n_layers=4)
_SDPA = dict(attn_backend="sdpa", attn_mask_type="causal")
register_flavor("deepseek_v3", "16B_4layers", _DSV3_16B)
register_flavor("deepseek_v3", "16B_4layers_sdpa", replace(_DSV3_16B, **_SDPA))
register_flavor(
    "deepseek_v3",
    "16B_4layers_sdpa_loop",
    replace(_DSV3_16B, **_SDPA, moe_args=replace(_DSV3_16B.moe_args, use_grouped_mm=False)),
)
register_flavor("qwen3", "30B-A3B_4layers", get_model_family("qwen3").args_for("30B-A3B", n_layers=4))

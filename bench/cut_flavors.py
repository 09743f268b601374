"""Published block shapes with only a few blocks: what one GPU can hold of a large model.

bench/memory_vs_gpu.py and bench/gpu_throughput.py import this through `--experimental.custom_import
cut_flavors`, in the dry run and in the training run alike, so both see the same flavors; torchtitan
0.2.2 imports it the same way in bench/gpu_throughput.py and gets the same cuts of its own flavors:
- llama3 `8B_4layers`: Llama 3.1 8B's blocks, 4 of them;
- deepseek_v3 `16B_4layers`: DeepSeek-V2-Lite's (1 dense block, 3 MoE blocks of 64 experts, top 6),
  with `_sdpa` its attention as SDPA causal instead of flex block-causal, and `_loop` its experts
  computed expert by expert instead of grouped matmuls (Titan only);
- qwen3 `30B-A3B_4layers`: Qwen3-30B-A3B's MoE blocks (128 experts, top 8), 4 of them.
"""

from __future__ import annotations

import sys
from dataclasses import replace

CUT_LAYERS = 4


def _register_titan() -> None:
    from titan_train.registry import get_model_family, register_flavor

    register_flavor("llama3", "8B_4layers", get_model_family("llama3").args_for("8B", n_layers=CUT_LAYERS))
    dsv3_16b = get_model_family("deepseek_v3").args_for("16B", n_layers=CUT_LAYERS)
    sdpa = dict(attn_backend="sdpa", attn_mask_type="causal")
    register_flavor("deepseek_v3", "16B_4layers", dsv3_16b)
    register_flavor("deepseek_v3", "16B_4layers_sdpa", replace(dsv3_16b, **sdpa))
    register_flavor(
        "deepseek_v3",
        "16B_4layers_sdpa_loop",
        replace(dsv3_16b, **sdpa, moe_args=replace(dsv3_16b.moe_args, use_grouped_mm=False)),
    )
    qwen3 = get_model_family("qwen3").args_for("30B-A3B", n_layers=CUT_LAYERS)
    register_flavor("qwen3", "30B-A3B_4layers", qwen3)


def _register_torchtitan() -> None:
    import untied_flavors  # noqa: F401  (its import prints torchtitan's peak active bytes per log line)
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.qwen3 import qwen3_args

    deepseekv3_args["16B_4layers"] = replace(deepseekv3_args["16B"], n_layers=CUT_LAYERS)
    qwen3_args["30B-A3B_4layers"] = replace(qwen3_args["30B-A3B"], n_layers=CUT_LAYERS)


# Register with the trainer that is importing this file (both may be installed).
if "titan_train" in sys.modules:
    _register_titan()
if "torchtitan" in sys.modules:
    _register_torchtitan()

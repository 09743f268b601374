"""Named Llama 4 shapes under torchtitan 0.2.2's flavor names, and the published attention under names
of its own.

17bx16e is Llama 4 Scout (16 experts, every layer MoE, Llama 3.1-style rotary stretch by 16 over an
original 8192 positions); 17bx128e is Maverick (128 experts on every other layer, no rotary stretch).
Both have 48 layers of width 5120, 40 query and 8 key/value heads, one shared expert and top-1 sigmoid
routing.

The `_irope` flavors compute what torchtitan 0.2.2's flavors of that name compute: a no-rope layer every
4th layer starting at layer 0, chunked attention (8192; 256 for the debug model) on the rope layers,
flex attention over packed documents, and nothing else (no QK norm, no temperature tuning), so a
torchtitan checkpoint trains on as it did there. The `_published` flavors add what Meta's published
checkpoints (and Hugging Face's `Llama4ForCausalLM`) compute: the no-rope layers at 3, 7, ..., queries
scaled by temperature tuning on them, and, where the published model has it (Scout, not Maverick), QK norm
on the rope layers.
"""

from __future__ import annotations

from dataclasses import replace

from titan_models.args import RopeScaling
from titan_models.errors import ModelConfigError
from titan_models.llama4.args import Llama4Args, llama4_moe_args

# Scout's stretch: torchtitan's RoPEScalingArgs defaults (factor 16, low 1, high 1, original 8192).
SCOUT_ROPE_SCALING = RopeScaling(
    factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_seq_len=8192
)
_BIG = dict(
    dim=5120,
    n_layers=48,
    n_heads=40,
    n_kv_heads=8,
    ffn_dim_multiplier=1.2,
    multiple_of=2048,
    rope_theta=500000,
    max_seq_len=8192,
)
# torchtitan 0.2.2's iRoPE (`every_n_layers_nope=4`, `fixed_attn_block_size=8192`, flex, block_causal).
_IROPE = dict(
    every_n_layers_nope=4,
    first_nope_layer=0,
    attn_chunk_size=8192,
    attn_backend="flex",
    attn_mask_type="block_causal",
)
# Meta's published layout (Hugging Face's `no_rope_layers`, `attn_temperature_tuning`, `floor_scale`, ...).
_PUBLISHED = dict(
    _IROPE,
    first_nope_layer=None,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
)

_DEBUG = Llama4Args(
    dim=256,
    n_layers=6,
    n_heads=16,
    vocab_size=2048,
    rope_theta=500000,
    rope_scaling=SCOUT_ROPE_SCALING,
    moe_args=llama4_moe_args(8),
)
_SCOUT = Llama4Args(
    rope_scaling=SCOUT_ROPE_SCALING,
    context_len=10_485_760,
    moe_args=llama4_moe_args(16),
    interleave_moe_layer_step=1,
    **_BIG,
)
_MAVERICK = Llama4Args(
    context_len=1_048_576, moe_args=llama4_moe_args(128), interleave_moe_layer_step=2, **_BIG
)

LLAMA4_FLAVORS: dict[str, Llama4Args] = {
    "debugmodel": _DEBUG,
    "17bx16e": _SCOUT,
    "17bx128e": _MAVERICK,
    "debugmodel_irope": replace(_DEBUG, **{**_IROPE, "attn_chunk_size": 256}),
    "17bx16e_irope": replace(_SCOUT, **_IROPE),
    "17bx128e_irope": replace(_MAVERICK, **_IROPE),
    "debugmodel_published": replace(_DEBUG, **{**_PUBLISHED, "attn_chunk_size": 256}, use_qk_norm=True),
    "17bx16e_published": replace(_SCOUT, **_PUBLISHED, use_qk_norm=True),
    "17bx128e_published": replace(_MAVERICK, **_PUBLISHED, use_qk_norm=False),
}


def llama4_args(flavor: str) -> Llama4Args:
    """A fresh copy of a Llama 4 flavor's args (callers may change fields such as max_seq_len)."""
    if flavor not in LLAMA4_FLAVORS:
        raise ModelConfigError(
            f"model: unknown llama4 flavor '{flavor}'; choose one of {', '.join(LLAMA4_FLAVORS)}"
        )
    return replace(LLAMA4_FLAVORS[flavor])

"""The shape of a DeepSeek-V2/V3 model: multi-head latent attention, YaRN rotary scaling, dense then MoE blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from titan_models.decoder_args import attention_checks, require
from titan_models.moe import MoEArgs

ATTENTION_BACKENDS = ("sdpa", "flex")
_NARROW_VALUE_HEADS = " for DeepSeek-V3 (its value heads are narrower than its query/key heads)"


@dataclass
class DeepSeekV3Args:
    """Hyper-parameters of a DeepSeek-V3 transformer, with torchtitan 0.2.2's field names and defaults
    (except `attn_backend`, Titan's name for torchtitan's `attn_type`).

    The first `n_dense_layers` blocks use a SwiGLU of width `inter_dim`; the rest an MoE (`moe_args`) whose
    experts have width `moe_inter_dim`. Attention is multi-head latent attention: queries come straight
    from `dim` (`q_lora_rank=0`) or through a rank-`q_lora_rank` bottleneck; keys and values from a shared
    rank-`kv_lora_rank` latent; each head's query/key is `qk_nope_head_dim` dimensions without position
    plus `qk_rope_head_dim` rotated ones (the rotated key part is shared by all heads).

    YaRN stretches the rotary frequencies by `rope_factor` (band set by `beta_fast`/`beta_slow` around
    `original_seq_len`) and multiplies the softmax scale by (0.1 * mscale * ln(rope_factor) + 1)^2.
    `yarn=None` applies it as torchtitan does, only when the run's `max_seq_len` exceeds
    `original_seq_len`; True applies it always, as Hugging Face does when a config.json names yarn.
    """

    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1
    n_heads: int = 16
    vocab_size: int = 102400
    inter_dim: int = 10944
    moe_inter_dim: int = 1408
    norm_eps: float = 1e-5
    moe_args: MoEArgs = field(default_factory=MoEArgs)
    # Multi-head latent attention: low-rank query and key/value latents, decoupled rotary part.
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # eps of the norms on the query and key/value latents; None: norm_eps (Hugging Face's models fix 1e-6).
    latent_norm_eps: float | None = None
    # eps of the final norm; None: torch's RMSNorm default (the dtype's machine epsilon), as torchtitan
    # 0.2.2 builds it. Hugging Face's models use rms_norm_eps (set so when imported from config.json).
    final_norm_eps: float | None = None
    # The fields that hold a norm epsilon (a published config.json may state its own).
    norm_epsilon_fields: ClassVar[tuple[str, ...]] = ("norm_eps", "latent_norm_eps", "final_norm_eps")
    attn_backend: str = "sdpa"
    attn_mask_type: str = "causal"
    # Positions the rotary table is built for: a run sets it to its longest sequence.
    max_seq_len: int = 4096 * 4
    # The longest sequence the flavor is published for; None: max_seq_len.
    context_len: int | None = None
    # YaRN: the rotary frequencies stretched beyond original_seq_len.
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    yarn: bool | None = None
    eos_id: int | None = None
    # Read by the trainer's FLOP count and dry run like a Llama's; DeepSeek never ties them.
    tie_word_embeddings: bool = False
    depth_init: bool = True
    # Multi-token-prediction depths after the last block (DeepSeek-V3's num_nextn_predict_layers; see
    # titan_models.deepseek_v3.mtp); 0: none.
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.context_len is None:
            self.context_len = self.max_seq_len
        positive = ("dim", "n_layers", "n_heads", "vocab_size", "inter_dim", "moe_inter_dim", "kv_lora_rank")
        positive += ("qk_rope_head_dim", "v_head_dim")
        require(
            [
                *((getattr(self, n) >= 1, f"{n} ({getattr(self, n)}) must be at least 1") for n in positive),
                (
                    self.q_lora_rank >= 0,
                    f"q_lora_rank ({self.q_lora_rank}) must be 0 (no bottleneck) or more",
                ),
                (
                    0 <= self.n_dense_layers <= self.n_layers,
                    f"n_dense_layers ({self.n_dense_layers}) must be between 0 and n_layers ({self.n_layers})",
                ),
                (
                    self.qk_rope_head_dim % 2 == 0,
                    f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary pairs",
                ),
                (
                    self.num_mtp_layers >= 0,
                    f"num_mtp_layers ({self.num_mtp_layers}) must be 0 (no multi-token prediction) or more",
                ),
                (self.rope_factor >= 1, f"rope_factor ({self.rope_factor}) must be at least 1"),
                *attention_checks(self, ATTENTION_BACKENDS, _NARROW_VALUE_HEADS),
            ]
        )

    @property
    def kv_heads(self) -> int:
        """Every head has its own keys and values (expanded from the shared latent)."""
        return self.n_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """Width of a query/key head (what a Llama-shaped memory estimate reads)."""
        return self.qk_head_dim

    def with_positions(self, positions: int) -> DeepSeekV3Args:
        """These args with a rotary table of `positions` rows and the same function: whether YaRN
        applies is decided by the run's max_seq_len, so a longer table for generation keeps that choice."""
        return replace(self, max_seq_len=positions, yarn=self.uses_yarn)

    @property
    def uses_yarn(self) -> bool:
        """Whether the rotary table and softmax scale carry YaRN's stretch for this max_seq_len."""
        if self.yarn is None:
            return self.max_seq_len > self.original_seq_len
        return self.yarn and self.rope_factor > 1

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.uses_yarn:
            m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

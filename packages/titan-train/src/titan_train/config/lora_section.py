"""(Titan) The [lora] section: low-rank adapters, switched on by `lora` in `model.converters`.

torchtitan 0.2.2 has no LoRA; the field names follow PEFT's `LoraConfig` (rank is its `r`, alpha its
`lora_alpha`), since PEFT is where the adapters go after training.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_train.config.fields import opt


@dataclass
class LoRA:
    rank: int = opt(8, "(Titan) Rank of each adapter (PEFT's r)", minimum=1, maximum=65536)
    alpha: float = opt(
        16.0, "(Titan) Adapter output is scaled by alpha / rank (PEFT's lora_alpha)", above=0, maximum=1e6
    )
    dropout: float = opt(0.0, "(Titan) Dropout on the adapter's input while training", minimum=0, below=1)
    target_modules: list[str] = opt(
        ["q_proj", "v_proj"],
        "(Titan) Linear layers that get adapters: Hugging Face names (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj), Titan's own (wq, wk, wv, wo, w1, w2, w3), or all-linear (every "
        "linear layer but the output head and MoE routers); routed experts never get adapters",
        nonempty=True,
    )
    train_embeddings: bool = opt(
        False,
        "(Titan) Train the token embedding and the output head in full beside the adapters (they stay "
        "frozen otherwise); the PEFT export saves them as modules_to_save",
    )
    save_adapter_only: bool = opt(
        True,
        "(Titan) Periodic checkpoints hold the trained weights (adapters), their optimizer state and the run's "
        "state, not the frozen base: a resume reads the base again from checkpoint.initial_load_path (or "
        "rebuilds the same initialisation), and is refused if it is gone; the last save holds the whole model "
        "(torchtitan's name)",
    )
    quantize_base: str = opt(
        "",
        "(torchtitan's name) QLoRA: \"nf4\" stores the frozen weights of the adapted layers in torchao's 4-bit "
        "NormalFloat once the base is loaded (about 0.52 bytes a parameter), the adapters in training.dtype; "
        '"" keeps the base as it is. One process or FSDP 2 (dp_shard, the NF4 base sharded; HSDP too); refused with '
        "tp, cp, pp, ep, dp_replicate without dp_shard, float8/mx converters or compile",
        choices=("", "nf4"),
    )
    nf4_scaler_block_size: int = opt(
        256,
        '(torchtitan\'s name) With quantize_base = "nf4": NF4 scales each block of 64 values, and quantises '
        "those scales in groups of this many; every adapted weight's size must be a multiple of 64 x this (under "
        "FSDP, each dp_shard rank's shard of it)",
        minimum=1,
        maximum=65536,
    )

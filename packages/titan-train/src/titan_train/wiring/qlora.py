"""QLoRA from `[lora] quantize_base = "nf4"`: the refusals at start, the quantisation after the base is loaded,
and the model state that saves and exports the base dequantised.

The base is quantised once it holds its final values: after the initial load or the resume (whose frozen base
is read again from its source, then the adapters over it), so a resumed run quantises the same weights into
the same NF4 codes (the quantisation is deterministic) and continues exactly. Checkpoints never hold NF4
tensors: adapter-only saves leave the base out, and a save of the whole model (the last one, a Hugging Face
export) holds the base dequantised, the values the run trained against; the merged export adds the adapters to
that dequantised base, as torchtune and PEFT merge a QLoRA model.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from torch import nn

from titan_ckpt import ModelState
from titan_parallel import (
    ParallelDims,
    dequantized,
    nf4_size_problem,
    quantize_base_to_nf4,
    target_linears,
    torchao_nf4_problem,
)
from titan_train.config import JobConfig
from titan_train.wiring.lora import HF_TO_TITAN, lora_enabled

NF4 = "nf4"
_QUANTISED_CONVERTERS = ("float8", "quantize.linear.float8", "mx", "quantize.linear.mx")


def qlora_enabled(config: JobConfig) -> bool:
    return lora_enabled(config) and config.lora.quantize_base == NF4


def torchao_version() -> str:
    """The installed torchao's version ("0" when it is missing)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def qlora_problems(config: JobConfig, dims: ParallelDims, model: nn.Module) -> list[str]:
    """Why `lora.quantize_base` cannot work in this run (one message each), checked on the meta model."""
    if config.lora.quantize_base != NF4:
        return []
    if not lora_enabled(config):
        return [
            'config: lora.quantize_base = "nf4" quantises the base under LoRA adapters, but model.converters '
            f'{config.model.converters} has no lora; add it (model.converters = [..., "lora"])'
        ]
    problems = []
    too_old = torchao_nf4_problem(torchao_version())
    if too_old:
        problems.append(f"config: {too_old}")
    float8 = [c for c in config.model.converters if c in _QUANTISED_CONVERTERS]
    if float8:
        problems.append(
            f'config: lora.quantize_base = "nf4" with model.converters {float8}: a linear layer holds either an '
            "NF4 base or a float8/MXFP8 one; drop one of them"
        )
    split = {
        name: degree
        for name, degree in (
            ("dp_shard", dims.dp_shard),
            ("dp_replicate", dims.dp_replicate),
            ("tp", dims.tp),
            ("cp", dims.cp),
            ("pp", dims.pp),
            ("ep", dims.ep),
        )
        if degree > 1
    }
    if split:
        problems.append(
            f'config: lora.quantize_base = "nf4" runs in one process; this run splits the model ({split}): '
            "Titan quantises the base after it is loaded, when FSDP already holds its own shards of it "
            "(sharding an NF4 base needs it loaded before FSDP wraps it, not done yet); train QLoRA on one "
            "process, or LoRA without quantize_base"
        )
    if config.compile.enable and "model" in config.compile.components:
        problems.append(
            'config: lora.quantize_base = "nf4" with compile.enable: compiling NF4 matmuls is not tested; set '
            "compile.enable = false"
        )
    targets = tuple(HF_TO_TITAN.get(t, t) for t in config.lora.target_modules)
    for name, linear in target_linears(model, targets).items():
        problem = nf4_size_problem(name, linear.weight.numel(), config.lora.nf4_scaler_block_size)
        if problem:
            problems.append(f"config: {problem}")
            break
    return problems


def quantize_parts(parts: list[nn.Module], config: JobConfig) -> None:
    """Store the frozen weight of every adapted linear of `parts` in NF4 (once the base is loaded)."""
    for part in parts:
        quantize_base_to_nf4(part, scaler_block_size=config.lora.nf4_scaler_block_size)


class DequantizedModelState(ModelState):
    """The model state with each NF4 weight in its original dtype: what saves and exports write (DCP and
    safetensors hold no NF4 tensors); loading goes into the model before it is quantised."""

    def state_dict(self) -> dict[str, Any]:
        return {key: dequantized(value) for key, value in super().state_dict().items()}

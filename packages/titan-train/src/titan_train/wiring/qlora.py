"""QLoRA from `[lora] quantize_base = "nf4"`: the refusals at start, the quantisation after the base is loaded,
and the model state that saves and exports the base dequantised. It runs in one process or under FSDP 2
(dp_shard, and HSDP), where each weight is quantised whole after the load and FSDP shards the NF4 tensor
(`titan_parallel.nf4_fsdp` says why not shard by shard); every other split is refused at start.

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
    NF4_BLOCK_SIZE,
    ParallelDims,
    dequantized,
    nf4_fsdp_torch_problem,
    nf4_shard_problem,
    nf4_size_problem,
    quantize_base_to_nf4,
    target_linears,
    torchao_nf4_problem,
)
from titan_train.config import JobConfig
from titan_train.config.converters import QUANTISED_CONVERTERS
from titan_train.wiring.lora import HF_TO_TITAN, lora_enabled

NF4 = "nf4"


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
    float8 = [c for c in config.model.converters if c in QUANTISED_CONVERTERS]
    if float8:
        problems.append(
            f'config: lora.quantize_base = "nf4" with model.converters {float8}: a linear layer holds either an '
            "NF4 base or a float8/MXFP8 one; drop one of them"
        )
    if dims.dp_shard > 1:
        too_old = nf4_fsdp_torch_problem()
        if too_old:
            problems.append(f"config: {too_old}")
    # dp_replicate with dp_shard is HSDP, which runs: FSDP's shards, replicated.
    split = {
        name: degree
        for name, degree in (
            ("dp_replicate", dims.dp_replicate if dims.dp_shard == 1 else 1),
            ("tp", dims.tp),
            ("cp", dims.cp),
            ("pp", dims.pp),
            ("ep", dims.ep),
        )
        if degree > 1
    }
    if split:
        problems.append(
            'config: lora.quantize_base = "nf4" runs in one process or under FSDP 2 (dp_shard, or HSDP with '
            f"dp_replicate); this run also splits the model by {split}, which no test covers for an NF4 base "
            "(tensor, context, expert and pipeline splits, and replicas without dp_shard, are not wired for NF4 "
            "weights): set those degrees to 1 and shard with dp_shard, or train LoRA without quantize_base"
        )
    if config.compile.enable and "model" in config.compile.components:
        problems.append(
            'config: lora.quantize_base = "nf4" with compile.enable: compiling NF4 matmuls is not tested; set '
            "compile.enable = false"
        )
    targets = tuple(HF_TO_TITAN.get(t, t) for t in config.lora.target_modules)
    group = NF4_BLOCK_SIZE * config.lora.nf4_scaler_block_size
    for name, linear in target_linears(model, targets).items():
        problem = nf4_size_problem(name, linear.weight.numel(), config.lora.nf4_scaler_block_size)
        if problem is None and dims.dp_shard > 1:
            problem = nf4_shard_problem(name, tuple(linear.weight.shape), dims.dp_shard, group)
        if problem:
            problems.append(f"config: {_as_written(problem, name, config.lora.target_modules)}")
            break
    return problems


def _as_written(problem: str, name: str, target_modules: list[str]) -> str:
    """`problem` naming the layer by the Hugging Face module name the user wrote in lora.target_modules
    (`q_proj in layers.0`), with Titan's name beside it; as it is where the user wrote Titan's."""
    leaf = name.rsplit(".", 1)[-1]
    written = {HF_TO_TITAN.get(t, t): t for t in target_modules}.get(leaf, leaf)
    if written == leaf:
        return problem
    block = ".".join(name.split(".")[:2])
    return problem.replace(f"{name}.weight", f"{written} in {block} (Titan's {name}.weight)", 1)


def quantize_parts(parts: list[nn.Module], config: JobConfig) -> None:
    """Store the frozen weight of every adapted linear of `parts` in NF4 (once the base is loaded)."""
    for part in parts:
        quantize_base_to_nf4(part, scaler_block_size=config.lora.nf4_scaler_block_size)


class DequantizedModelState(ModelState):
    """The model state with each NF4 weight in its original dtype: what saves and exports write (DCP and
    safetensors hold no NF4 tensors); loading goes into the model before it is quantised."""

    def state_dict(self) -> dict[str, Any]:
        return {key: dequantized(value) for key, value in super().state_dict().items()}

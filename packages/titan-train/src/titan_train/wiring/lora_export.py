"""LoRA runs and Hugging Face files: the base imported with fresh adapters, exported merged, and the
adapters alone as a PEFT folder.

Both directions go through the family's own weight mapping, so every renaming and re-layout it does to
a weight (a per-head row permutation of the query and key projections) is done to the adapters
too: `lora_B` (out x rank) has the weight's rows, `lora_A` (rank x in) its columns, which no mapping
re-orders. To learn where each `lora_B` goes, the mapping is run once on the state dict with each
adapted weight replaced by `[code | B]`, where the code column names the layer and row; what comes out
says, for every Hugging Face tensor, which layer it was and in which row order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from titan_ckpt import HFStateDictAdapter
from titan_parallel import LoRA, initial_lora_weight, is_adapter_parameter, plain_name
from titan_train.config import JobConfig
from titan_train.wiring.hf_interop import export_dtype, tokenizer_files
from titan_train.wiring.lora import EMBEDDING_MODULES

logger = logging.getLogger(__name__)

PEFT_FOLDER = "peft_adapter"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ROW_BITS = 1 << 24  # rows per layer in the code column (float64 holds the codes exactly)


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {plain_name(name): t for name, t in state.items()}


def adapted_layers(state: dict[str, Any]) -> list[str]:
    """The layers of a state dict that carry adapters, by name (`layers.0.attention.wq`)."""
    return sorted(name.removesuffix(".lora_A.weight") for name in state if name.endswith(".lora_A.weight"))


class LoRAStateDictAdapter:
    """A family's Hugging Face mapping for a model with adapters: `to_hf` writes the merged weights
    (`W + scale * B @ A`, computed in float32), `from_hf` reads the base and gives every adapter its
    initial value (`titan_parallel.initial_lora_weight`), as a run without the import would start."""

    def __init__(
        self, base: HFStateDictAdapter, *, scale: float, adapter_shapes: dict[str, tuple], seed: int
    ):
        self.base, self.scale, self.seed = base, scale, seed
        self.adapter_shapes = adapter_shapes

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.base.to_hf(merged_state(_plain(state_dict), self.scale))

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = self.base.from_hf(hf_state_dict)
        for name, shape in self.adapter_shapes.items():
            ours[name] = initial_lora_weight(name, shape, self.seed)
        return ours

    def hf_config(self) -> dict:
        return self.base.hf_config()


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`state` without adapter tensors, each adapted weight replaced by `W + scale * B @ A`."""
    merged = {name: t for name, t in state.items() if not is_adapter_parameter(name)}
    for layer in adapted_layers(state):
        weight = state[f"{layer}.weight"]
        delta = state[f"{layer}.lora_B.weight"].float() @ state[f"{layer}.lora_A.weight"].float()
        merged[f"{layer}.weight"] = (weight.float() + scale * delta).to(weight.dtype)
    return merged


def peft_tensors(state: dict[str, torch.Tensor], base: HFStateDictAdapter, *, embeddings: bool) -> dict:
    """The adapters of a full state dict under PEFT's names and in the Hugging Face layout, with the
    embedding and output head (`embeddings`, trained in full) as PEFT's modules_to_save."""
    state = _plain(state)
    layers = adapted_layers(state)
    probe = {name: t for name, t in state.items() if not is_adapter_parameter(name)}
    for index, layer in enumerate(layers):
        b = state[f"{layer}.lora_B.weight"].double()
        code = index * _ROW_BITS + torch.arange(b.shape[0], dtype=torch.float64)
        probe[f"{layer}.weight"] = torch.cat([code[:, None], b], dim=1)
    out = {}
    for hf_name, tensor in base.to_hf(probe).items():
        if tensor.dtype == torch.float64:
            codes = tensor[:, 0].long()
            layer = layers[int(codes[0]) // _ROW_BITS]
            if not bool((codes // _ROW_BITS == codes[0] // _ROW_BITS).all()):
                raise ValueError(f"the Hugging Face mapping mixes rows of {layer} with another layer's")
            module = PEFT_PREFIX + hf_name.removesuffix(".weight")
            a = state[f"{layer}.lora_A.weight"]
            out[f"{module}.lora_A.weight"] = a.contiguous()
            out[f"{module}.lora_B.weight"] = tensor[:, 1:].to(a.dtype).contiguous()
        elif embeddings and hf_name.removesuffix(".weight").rsplit(".", 1)[-1] in EMBEDDING_MODULES.values():
            out[PEFT_PREFIX + hf_name] = tensor.contiguous()
    return out


def peft_config(lora: LoRA, tensors: dict, base_model: str) -> dict:
    """`adapter_config.json` for PEFT's LoraConfig: the run's rank, alpha and dropout (its `LoRA` options,
    as the adapters were built with them), the adapted module names."""
    targets = sorted({name.split(".")[-3] for name in tensors if name.endswith(".lora_A.weight")})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": sorted(EMBEDDING_MODULES[m] for m in lora.trainable) or None,
    }


def _is_trained_embedding(name: str, embeddings: bool) -> bool:
    return embeddings and plain_name(name).split(".", 1)[0] in EMBEDDING_MODULES


def gather_adapters(state: dict[str, Any], *, embeddings: bool) -> dict[str, torch.Tensor]:
    """The adapters (and the embeddings when trained in full) unsharded on rank 0's CPU, every rank
    taking part; an empty dict elsewhere. A small share of the model: the merged weights are written by
    every rank through the Hugging Face export, never gathered here."""
    names = [
        n
        for n, t in state.items()
        if isinstance(t, torch.Tensor)
        and (is_adapter_parameter(plain_name(n)) or _is_trained_embedding(n, embeddings))
    ]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, names)
        if any(other != names for other in every):
            raise ValueError(
                "lora: the PEFT adapter folder needs every rank to hold every adapter, but the ranks hold "
                "different layers (pipeline parallelism); the merged Hugging Face export is written, and the "
                "adapters can be taken from the DCP checkpoint with one process"
            )
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name in names:
        tensor = state[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # collective: every rank, the same order
        if keep:
            out[name] = tensor.detach().cpu()
    return out


def write_peft_adapter(
    config: JobConfig, model_state: dict[str, Any], base: HFStateDictAdapter, folder: Path, *, lora: LoRA
) -> Path | None:
    """Gather the adapters (every rank takes part) and write them on rank 0 as a PEFT folder,
    `folder/peft_adapter`: `adapter_model.safetensors`, `adapter_config.json`, the tokenizer files and the
    run's chat template. The Hugging Face base
    it names is the folder the run imported (`checkpoint.initial_load_path`, else `model.hf_assets_path`)."""
    embeddings = bool(lora.trainable)
    adapters = gather_adapters(model_state, embeddings=embeddings)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    # The mapping wants the whole model's names: the weights nobody exports here stand in on the meta device.
    stand_ins = {
        n: torch.empty(t.shape, dtype=t.dtype, device="meta")
        for n, t in model_state.items()
        if isinstance(t, torch.Tensor) and n not in adapters
    }
    tensors = peft_tensors(stand_ins | adapters, base, embeddings=embeddings)
    c = config.checkpoint
    source = c.initial_load_path or config.model.hf_assets_path
    out = folder / PEFT_FOLDER
    partial = folder / f"{PEFT_FOLDER}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, export_dtype(config))
    save_file(
        {k: v.to(dtype) for k, v in tensors.items()}, str(partial / PEFT_WEIGHTS), metadata={"format": "pt"}
    )
    for name, content in tokenizer_files(config).items():  # PEFT users load the tokenizer from here too
        (partial / name).write_bytes(content.read_bytes() if isinstance(content, Path) else content)
    (partial / PEFT_CONFIG).write_text(
        json.dumps(peft_config(lora, tensors, str(Path(source).resolve()) if source else ""), indent=2)
    )
    partial.rename(out)
    logger.info("lora: PEFT adapter (%d tensors) written to %s", len(tensors), out)
    return out

"""Write a DeepSeek-V3-style FP8 block-quantised checkpoint from a bf16 (or fp32) Hugging Face DeepSeek-V3 folder.

The published DeepSeek-V3 / V3.1 / R1 weights are in this format, which nothing here may download: each
linear weight of the decoder blocks as float8 e4m3 with a float32 `<name>_scale_inv` per 128x128 block
(weight = fp8 * scale_inv, edge blocks partial), config.json's `quantization_config`, and one
multi-token-prediction layer after the last block (`num_nextn_predict_layers: 1`). Tests build a tiny
model with transformers and convert it with this script to check Titan's import against transformers.

    python apps/scripts/make_fp8_checkpoint.py SOURCE_FOLDER OUTPUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (128, 128)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}
# Weights the published checkpoint keeps in bf16: embeddings, the output head, norms and the router.
_KEPT = re.compile(r"(embed_tokens|lm_head|norm|mlp\.gate\.weight|shared_head\.head|e_score_correction_bias)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 weight, float32 scale_inv per block) with weight ~= fp8 * scale_inv, as DeepSeek quantises."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32)
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            s = w[r, c].abs().max().clamp(min=1e-12) / E4M3_MAX
            scale[i, j] = s
            fp8[r, c] = (w[r, c] / s).to(torch.float8_e4m3fn)
    return fp8, scale


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


def _mtp_layer(tensors: dict[str, torch.Tensor], n_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer at index `n_layers`: a copy of the last block plus the MTP-only
    tensors (embedding, the two norms, `eh_proj`, the shared head), with random values."""
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    mtp = {
        f"model.layers.{n_layers}." + k[len(last) :]: v.clone()
        for k, v in tensors.items()
        if k.startswith(last)
    }
    embed = tensors["model.embed_tokens.weight"]
    vocab, dim = embed.shape
    prefix = f"model.layers.{n_layers}."
    for name, shape in (
        ("embed_tokens.weight", (vocab, dim)),
        ("enorm.weight", (dim,)),
        ("hnorm.weight", (dim,)),
        ("eh_proj.weight", (dim, 2 * dim)),
        ("shared_head.norm.weight", (dim,)),
        ("shared_head.head.weight", (vocab, dim)),
    ):
        mtp[prefix + name] = (torch.randn(shape, generator=g) * 0.02).to(embed.dtype)
    return mtp


def write_fp8_checkpoint(source: Path, output: Path, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Convert the DeepSeek-V3 folder `source` into the published FP8 format in `output` (one MTP layer
    added); other files (tokenizer, generation config) are copied. Returns the tensors written."""
    config = json.loads((source / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    tensors = _read(source)
    tensors |= _mtp_layer(tensors, n_layers, seed)
    written: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.ndim == 2 and name.endswith(".weight") and not _KEPT.search(name):
            written[name], written[f"{name}_scale_inv"] = quantize_blocks(tensor)
        else:
            written[name] = tensor.contiguous()
    output.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if (
            file.is_file()
            and file.name != "config.json"
            and not file.name.endswith(("safetensors", ".json.idx"))
        ):
            if not file.name.endswith(".safetensors.index.json"):
                shutil.copyfile(file, output / file.name)
    # Two shards, the MTP layer in the second, as the published checkpoint keeps layer 61 apart.
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in written.items():
        mtp = (m := _LAYER.match(name)) and int(m.group(1)) >= n_layers
        shards["model-00002-of-00002.safetensors" if mtp else "model-00001-of-00002.safetensors"][name] = (
            tensor
        )
    for file, part in shards.items():
        save_file(part, str(output / file), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in written.values())},
        "weight_map": {name: file for file, part in shards.items() for name in sorted(part)},
    }
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config |= {"quantization_config": QUANTIZATION_CONFIG, "num_nextn_predict_layers": 1}
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "source", type=Path, help="a Hugging Face DeepSeek-V3 folder (bf16 or fp32 safetensors)"
    )
    parser.add_argument("output", type=Path, help="where to write the FP8 block-quantised checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of the MTP layer's own tensors")
    args = parser.parse_args()
    written = write_fp8_checkpoint(args.source, args.output, seed=args.seed)
    quantised = sum(name.endswith("_scale_inv") for name in written)
    print(f"wrote {len(written)} tensors ({quantised} float8 weights with block scales) to {args.output}")


if __name__ == "__main__":
    main()

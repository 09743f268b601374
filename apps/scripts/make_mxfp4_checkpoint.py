"""Write a gpt-oss MXFP4 checkpoint, as OpenAI publishes gpt-oss-20b/-120b, from a bf16 Hugging Face folder.

The published weights keep every expert projection in MXFP4, which nothing here may download: in
transformers' names, `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` become `<name>_blocks`
(experts, out, in/32, 16) uint8, two FP4 E2M1 codes a byte with the low nibble first, and
`<name>_scales` (experts, out, in/32) uint8, one exponent per 32 values with bias 127; the bf16
folder's (experts, in, out) matrices are transposed to (experts, out, in) first. Everything else
(attention, router, embeddings, head, norms, sinks, expert biases) stays as it was, and config.json
gains the published `quantization_config`. Tests build a tiny model with transformers and convert it
with this script to check Titan's import.

    python apps/scripts/make_mxfp4_checkpoint.py SOURCE_FOLDER OUTPUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
SCALE_BIAS = 127
QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
QUANTISED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 codes 0-7; code | 8 is negative


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (..., n/32, 16), scales (..., n/32)) of a (..., n) weight: per 32 values the exponent
    floor(log2(max |x|)) - 2 (E2M1's largest value is 1.5 * 2**2), each value rounded to the nearest code."""
    *prefix, n = weight.shape
    if n % GROUP:
        raise SystemExit(f"make_mxfp4_checkpoint: the last dimension {n} is not a multiple of {GROUP}")
    x = weight.to(torch.float32).reshape(*prefix, n // GROUP, GROUP)
    amax = x.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -SCALE_BIAS))
    exponent = exponent.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - _MAGNITUDES).abs().argmin(dim=-1)
    code = code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


def write_mxfp4_checkpoint(source: Path, output: Path) -> dict[str, torch.Tensor]:
    """Convert the bf16 gpt-oss folder `source` into the published MXFP4 format in `output`; other files
    (tokenizer, chat template, generation config) are copied. Returns the tensors written."""
    config = json.loads((source / "config.json").read_text())
    written: dict[str, torch.Tensor] = {}
    for name, tensor in _read(source).items():
        if name.endswith(QUANTISED):
            blocks, scales = quantize_mxfp4(tensor.transpose(-2, -1))
            written[f"{name}_blocks"], written[f"{name}_scales"] = blocks, scales
        else:
            written[name] = tensor.contiguous()
    if not any(name.endswith("_blocks") for name in written):
        raise SystemExit(f"make_mxfp4_checkpoint: {source} has no mlp.experts.gate_up_proj; is it gpt-oss?")
    output.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.name != "config.json" and not file.name.startswith("model"):
            shutil.copyfile(file, output / file.name)
    shard = "model-00000-of-00001.safetensors"  # the published folders count shards from 0
    save_file(written, str(output / shard), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in written.values())},
        "weight_map": {name: shard for name in sorted(written)},
    }
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["quantization_config"] = QUANTIZATION_CONFIG
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a Hugging Face gpt-oss folder (bf16 or fp32 safetensors)")
    parser.add_argument("output", type=Path, help="where to write the MXFP4 checkpoint")
    args = parser.parse_args()
    written = write_mxfp4_checkpoint(args.source, args.output)
    quantised = sum(name.endswith("_blocks") for name in written)
    print(f"wrote {len(written)} tensors ({quantised} MXFP4 expert weights with scales) to {args.output}")


if __name__ == "__main__":
    main()

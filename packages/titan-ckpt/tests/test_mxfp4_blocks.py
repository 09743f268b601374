"""gpt-oss's MXFP4 weights decoded by Titan: against a decode written here from the format's definition
(bit fields of E2M1, exponent bias 127, low nibble first), lazily per slice, and in the folder that
`apps/scripts/make_mxfp4_checkpoint.py` writes, which transformers' own MXFP4 loader reads the same."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from titan_ckpt.errors import CheckpointError
from titan_ckpt.hf_files import index_hf_folder, read_tensors
from titan_ckpt.hf_quantized import folder_dequantizer
from titan_ckpt.mxfp4_blocks import Mxfp4Dequantized, dequantize_mxfp4

_SCRIPT = Path(__file__).parents[3] / "apps" / "scripts" / "make_mxfp4_checkpoint.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_mxfp4_checkpoint", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _e2m1(code: int) -> float:
    """FP4 E2M1 from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def _direct_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Byte by byte in Python floats: value 2k of a group is the low nibble of byte k, 2k+1 the high one."""
    *prefix, groups, width = blocks.shape
    flat_b, flat_s = blocks.reshape(-1, groups, width).tolist(), scales.reshape(-1, groups).tolist()
    rows = []
    for row_b, row_s in zip(flat_b, flat_s, strict=True):
        row = []
        for group, scale in zip(row_b, row_s, strict=True):
            for byte in group:
                row += [_e2m1(byte & 0xF) * 2.0 ** (scale - 127), _e2m1(byte >> 4) * 2.0 ** (scale - 127)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(*prefix, groups * width * 2)


def _random_pair(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, shape, generator=g, dtype=torch.uint8)
    scales.view(-1)[:3] = torch.tensor([0, 1, 200], dtype=torch.uint8)  # 2**-127 is subnormal in float32
    return blocks, scales


def _read_dequantized(folder, forced):
    """Every tensor of the folder as the import's dequantizer gives it."""
    stored = index_hf_folder(folder)
    dequantize = folder_dequantizer(folder, stored, forced)
    tensors = read_tensors(stored, set(stored))
    return tensors if dequantize is None else dequantize(tensors)


def test_dequantised_mxfp4_equals_a_direct_decode_of_every_nibble_exactly():
    blocks, scales = _random_pair((3, 5, 2), seed=0)
    expected = _direct_decode(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales).to(torch.float64), expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).to(torch.float64), expected)
    # The nibble order, spelled out: byte 0x2F (low 0xF = -6, high 0x2 = 1.0) at exponent 0 (scale 127).
    one = torch.zeros(1, 1, 16, dtype=torch.uint8)
    one[0, 0, 0] = 0x2F
    assert dequantize_mxfp4(one, torch.full((1, 1), 127, dtype=torch.uint8))[0, :2].tolist() == [-6.0, 1.0]


def test_a_lazy_mxfp4_weight_reads_any_slice_equal_to_the_whole_decode_in_both_layouts():
    blocks, scales = _random_pair((4, 6, 3), seed=1)  # (experts, rows, groups): 96 columns
    whole = dequantize_mxfp4(blocks, scales)
    lazy = Mxfp4Dequantized(blocks, scales)
    assert lazy.shape == whole.shape
    for index in [(slice(1, 3),), (slice(None), slice(2, 5)), (slice(0, 4), slice(None), slice(5, 71))]:
        assert torch.equal(lazy[index], whole[index])
    transposed = lazy.transpose(1, 2)
    assert transposed.shape == (4, 96, 6)
    assert torch.equal(transposed[1:3, 40:90, 2:4], whole.transpose(1, 2)[1:3, 40:90, 2:4])
    assert torch.equal(transposed.transpose(1, 2)[2:4], whole[2:4])
    assert torch.equal(lazy.to(torch.float64), whole.to(torch.float64))  # any other use decodes it whole


def _tiny_gpt_oss(folder: Path) -> None:
    # A dev dependency of the workspace, absent where titan-ckpt is installed alone (the floor check).
    transformers = pytest.importorskip("transformers")
    GptOssConfig, GptOssForCausalLM = transformers.GptOssConfig, transformers.GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(folder)


def test_the_mxfp4_script_writes_the_published_layout_which_titan_and_transformers_decode_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    AutoModelForCausalLM, Mxfp4Config = transformers.AutoModelForCausalLM, transformers.Mxfp4Config

    bf16, mxfp4 = tmp_path / "bf16", tmp_path / "mxfp4"
    _tiny_gpt_oss(bf16)
    script = _script()
    script.write_mxfp4_checkpoint(bf16, mxfp4)

    config = json.loads((mxfp4 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    written = load_file(str(next(mxfp4.glob("*.safetensors"))))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert (
        written[f"{name}_blocks"].shape == (4, 192, 2, 16) and written[f"{name}_blocks"].dtype == torch.uint8
    )
    assert written[f"{name}_scales"].shape == (4, 192, 2) and written[f"{name}_scales"].dtype == torch.uint8
    assert written["model.layers.1.mlp.experts.down_proj_blocks"].shape == (4, 64, 3, 16)
    assert written["model.layers.1.mlp.experts.gate_up_proj_bias"].dtype == torch.bfloat16
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in written)

    # Titan's read of the folder: each pair becomes the bf16 name in transformers' (E, in, out) layout.
    ours = _read_dequantized(mxfp4, forced=False)
    original = load_file(str(next(bf16.glob("*.safetensors"))))
    for proj in ("gate_up_proj", "down_proj"):
        for layer in range(2):
            base = f"model.layers.{layer}.mlp.experts.{proj}"
            direct = _direct_decode(written[f"{base}_blocks"], written[f"{base}_scales"]).transpose(1, 2)
            assert ours[base].shape == original[base].shape
            assert torch.equal(ours[base].full().to(torch.float64), direct)
            # The script's rounding: within 2 ** (exponent + 1) of the bf16 weight (the group's largest values,
            # up to 8 * 2 ** exponent, saturate at 6), and quantising the decoded weight again gives the same bytes.
            step = (
                torch.exp2(written[f"{base}_scales"].float() - 127).repeat_interleave(32, -1).transpose(1, 2)
            )
            assert ((ours[base].full() - original[base].float()).abs() <= 2 * step).all()
            again = script.quantize_mxfp4(ours[base].full().transpose(1, 2))
            assert torch.equal(again[0], written[f"{base}_blocks"])
            assert torch.equal(again[1], written[f"{base}_scales"])

    # transformers' own MXFP4 loader, dequantising, reads the same weights from the same folder.
    theirs = AutoModelForCausalLM.from_pretrained(
        mxfp4, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    for layer in range(2):
        experts = theirs.model.layers[layer].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            mine = ours[f"model.layers.{layer}.mlp.experts.{proj}"].full()
            assert torch.equal(getattr(experts, proj).detach().float(), mine)


def test_mxfp4_pairs_without_a_quantization_config_are_refused_in_one_line_unless_forced(tmp_path):
    bf16, mxfp4 = tmp_path / "bf16", tmp_path / "mxfp4"
    _tiny_gpt_oss(bf16)
    _script().write_mxfp4_checkpoint(bf16, mxfp4)
    config = json.loads((mxfp4 / "config.json").read_text())
    del config["quantization_config"]
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="initial_load_in_hf_quantized = true"):
        _read_dequantized(mxfp4, forced=False)
    forced = _read_dequantized(mxfp4, forced=True)
    assert isinstance(forced["model.layers.0.mlp.experts.down_proj"], Mxfp4Dequantized)

"""gpt-oss and Hugging Face both ways, through the trainer: transformers' `GptOssForCausalLM` bf16 layout
imports with its logits, the published MXFP4 format (written here by apps/scripts/make_mxfp4_checkpoint.py)
imports with transformers' logits on the dequantised weights, and a trained run's export loads with
AutoModelForCausalLM with Titan's logits. Every model is built here with transformers (nothing downloaded),
fp32, with random weights, biases, sinks and router biases."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config

from titan_ckpt.mxfp4_blocks import dequantize_mxfp4
from titan_models.gpt_oss import args_from_hf_config, to_hf_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

_SCRIPT = Path(__file__).parents[3] / "apps" / "scripts" / "make_mxfp4_checkpoint.py"
# gpt-oss's settings at a tiny size: YaRN by 8 over 256 original positions (the smallest length whose band
# edges stay inside the frequencies, where transformers would clamp them), a window of 8 on even layers,
# widths that are multiples of MXFP4's groups of 32.
_CONFIG = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=2048,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 256,
    },
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer (sinks and router bias included), norms around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                scale = 0.5 if name.endswith("sinks") else 0.1
                t.copy_(torch.randn(t.shape, generator=g) * scale + ("norm" in name))


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny GptOssForCausalLM saved by transformers (its bf16 layout, fp32 values) with the bundled tokenizer."""
    folder = tmp_path_factory.mktemp("gpt_oss_hf")
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**_CONFIG)).eval()
    _randomise(model, 0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder, model


def _trainer(small_config, dump: Path, folder: Path, one_rank, *flags: str) -> Trainer:
    config = small_config(
        dump,
        "--model.name",
        "gpt_oss",
        "--model.flavor",
        "from_hf",
        "--model.hf_assets_path",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
        "--training.steps",
        "0",
        *flags,
    )
    trainer = Trainer(resolve(config, 1, "cpu"), one_rank)
    trainer.train()
    return trainer


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))


def test_config_json_round_trips_through_titan_args_with_the_published_keys():
    args = args_from_hf_config(GptOssConfig(**_CONFIG).to_dict())
    assert (args.rope_factor, args.original_seq_len, args.ntk_alpha, args.ntk_beta) == (8.0, 256, 1.0, 32.0)
    assert (args.sliding_window_size, args.head_dim, args.moe_inter_dim, args.rope_theta) == (
        8,
        16,
        64,
        150000.0,
    )
    assert (args.moe_args.num_experts, args.moe_args.top_k) == (4, 2)
    written = to_hf_config(args)
    assert written["layer_types"] == ["sliding_attention", "full_attention"]
    assert written["rope_scaling"]["original_max_position_embeddings"] == 256
    again = GptOssConfig(**written)  # transformers reads what Titan writes as it reads the published file
    assert again.rope_parameters["factor"] == 8.0 and again.rope_parameters["rope_theta"] == 150000.0
    assert args_from_hf_config(again.to_dict()) == args


def test_a_gpt_oss_saved_by_transformers_imports_with_its_logits(
    tmp_path, bf16_folder, small_config, one_rank
):
    folder, hf = bf16_folder
    trainer = _trainer(small_config, tmp_path / "run", folder, one_rank)
    ours = trainer.model_parts[0].eval()
    tokens = _tokens(2048)
    with torch.no_grad():
        expected = hf(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5


def test_the_published_mxfp4_format_imports_equal_to_its_decode_with_transformers_logits(
    tmp_path, bf16_folder, small_config, one_rank
):
    folder, hf = bf16_folder
    spec = importlib.util.spec_from_file_location("make_mxfp4_checkpoint", _SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    mxfp4 = tmp_path / "mxfp4"
    written = script.write_mxfp4_checkpoint(folder, mxfp4)
    assert json.loads((mxfp4 / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"

    trainer = _trainer(small_config, tmp_path / "run", mxfp4, one_rank)
    ours = trainer.model_parts[0].eval()
    for layer in range(2):
        experts = (
            ours.layers[str(layer)].moe.experts
            if hasattr(ours.layers, "keys")
            else ours.layers[layer].moe.experts
        )
        base = f"model.layers.{layer}.mlp.experts"
        for mine, theirs in (("mlp1_weight", "gate_up_proj"), ("mlp2_weight", "down_proj")):
            decoded = dequantize_mxfp4(written[f"{base}.{theirs}_blocks"], written[f"{base}.{theirs}_scales"])
            assert torch.equal(getattr(experts, mine).detach(), decoded)

    dequantised = AutoModelForCausalLM.from_pretrained(
        mxfp4, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    tokens = _tokens(2048)
    with torch.no_grad():
        expected = dequantised(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() <= 1e-5
        assert (hf(tokens).logits - expected).abs().max().item() > 1e-3  # MXFP4 changed the experts


def test_a_trained_gpt_oss_run_exports_what_auto_model_loads_with_titan_s_logits(
    tmp_path, bf16_folder, small_config, one_rank
):
    folder, hf = bf16_folder
    # No expert-bias balancing: GptOssForCausalLM has no place for a trained bias (an export of one is
    # refused without checkpoint.hf_export_lossy, as for the other MoE families).
    trainer = _trainer(
        small_config,
        tmp_path / "run",
        folder,
        one_rank,
        "--training.steps",
        "1",
        "--checkpoint.last_save_in_hf",
        "--model.moe_load_balance_coeff",
        "0",
    )
    export = tmp_path / "run" / "checkpoint" / "step-1"
    config = json.loads((export / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"], config["rope_scaling"]["factor"]) == (
        ["GptOssForCausalLM"],
        8,
        8.0,
    )
    saved = {}
    for file in export.glob("*.safetensors"):
        saved |= load_file(str(file))
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = _tokens(2048)
    with torch.no_grad():
        ours = trainer.model_parts[0].eval()(tokens)
        assert (model(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (ours - hf(tokens).logits).abs().max().item() > 1e-3  # the step changed the weights

"""Published Hugging Face formats through the trainer's import: DeepSeek-V3's FP8 block-quantised weights
with their multi-token-prediction layer, and Llama 4's multimodal checkpoints. Each checkpoint is made
here with transformers (nothing downloaded) and compared with transformers' own logits (fp32)."""

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Llama4Config,
    Llama4ForConditionalGeneration,
)

from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

_SCRIPT = Path(__file__).parents[3] / "apps" / "scripts" / "make_fp8_checkpoint.py"


def _fp8_script():
    spec = importlib.util.spec_from_file_location("make_fp8_checkpoint", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer (the expert bias included), norms around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                scale = 0.05 if name.endswith("bias") else 0.1
                t.copy_(torch.randn(t.shape, generator=g) * scale + ("norm" in name))


def _dequantised_by_blocks(tensors: dict[str, torch.Tensor], block: int = 128) -> dict[str, torch.Tensor]:
    """The reference: each float8 weight times its block's scale, block by block (no MTP layer, no scales)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        w = t.to(torch.float32)
        scale = tensors.get(f"{name}_scale_inv")
        if scale is not None:
            w = w.clone()
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    w[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
        out[name] = w
    return out


def _trainer(small_config, dump: Path, folder: Path, one_rank, *flags: str) -> Trainer:
    config = small_config(
        dump,
        *flags,
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
    )
    trainer = Trainer(resolve(config, 1, "cpu"), one_rank)
    trainer.train()
    return trainer


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))


def test_fp8_block_quantised_deepseek_v3_imports_with_transformers_logits_on_the_dequantised_weights(
    tmp_path, small_config, one_rank, caplog
):
    # Sizes 160, 320, 144 leave partial 128x128 blocks at the edges; layer 1 is MoE (stacked experts).
    config = DeepseekV3Config(
        vocab_size=2048,
        hidden_size=160,
        intermediate_size=320,
        moe_intermediate_size=144,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=96,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    source = DeepseekV3ForCausalLM(config)
    _randomise(source, 0)
    bf16 = tmp_path / "bf16"
    source.to(torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, bf16 / name)
    fp8 = tmp_path / "fp8"
    _fp8_script().write_fp8_checkpoint(bf16, fp8)

    written = {}
    for file in fp8.glob("*.safetensors"):
        written |= load_file(str(file))
    assert written["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert written["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 2)
    assert "model.layers.2.eh_proj.weight" in written  # the MTP layer
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]

    reference_folder = tmp_path / "dequantised"
    reference_folder.mkdir()
    reference = {
        k: v for k, v in _dequantised_by_blocks(written).items() if not k.startswith("model.layers.2.")
    }
    save_file(reference, str(reference_folder / "model.safetensors"), metadata={"format": "pt"})
    (reference_folder / "config.json").write_text((bf16 / "config.json").read_text())
    expected_model = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    original = DeepseekV3ForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()

    with caplog.at_level(logging.INFO):
        trainer = _trainer(small_config, tmp_path / "run", fp8, one_rank, "--model.name", "deepseek_v3")
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "multi-token-prediction layer 2 " in m]) == 1, messages
    assert len([m for m in messages if "dequantising" in m]) == 1

    tokens = _tokens(config.vocab_size)
    with torch.no_grad():
        expected = expected_model(tokens).logits
        ours = trainer.model_parts[0].eval()(tokens)
        undequantised = original(tokens).logits
    assert (ours - expected).abs().max().item() <= 1e-5
    # The reference is the dequantised model, not the bf16 one it was quantised from.
    assert (undequantised - expected).abs().max().item() > 1e-3


def test_a_multimodal_llama4_checkpoint_imports_its_text_model_with_its_logits(
    tmp_path, small_config, one_rank, caplog
):
    # Scout's text settings at a tiny size: qk norm, no rope every 4th layer, chunked attention on the
    # rope layers, MoE every 2nd layer, Llama 3 rotary scaling; a small vision tower and projector.
    text = dict(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        intermediate_size_mlp=160,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=16,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    )
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        projector_input_dim=64,
        projector_output_dim=64,
        vision_output_dim=64,
    )
    config = Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = Llama4ForConditionalGeneration(config).eval()
    _randomise(hf, 1)
    folder = tmp_path / "scout_tiny"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    saved = json.loads((folder / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("llama4", ["Llama4ForConditionalGeneration"])

    with caplog.at_level(logging.INFO):
        trainer = _trainer(small_config, tmp_path / "run", folder, one_rank, "--model.name", "llama4")
    skipped = [r.getMessage() for r in caplog.records if "vision tower and projector" in r.getMessage()]
    assert len(skipped) == 1, skipped
    args = trainer.model_parts[0].args
    assert (args.n_layers, args.every_n_layers_nope, args.attn_chunk_size) == (4, 4, 16)

    tokens = _tokens(2048)
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        ours = trainer.model_parts[0].eval()(tokens)
    assert (ours - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5


_PUBLISHED = Path(__file__).parent / "published_configs"


@pytest.mark.parametrize(
    ("family", "flavor", "published", "total"),
    [
        ("llama3", "8B", "Llama-3.1-8B", 8_030_261_248),
        ("llama3", "70B", "Llama-3.1-70B", 70_553_706_496),
        ("qwen3", "8B", "Qwen3-8B", 8_190_735_360),
        ("qwen3", "30B-A3B", "Qwen3-30B-A3B", 30_532_122_624),
        ("deepseek_v3", "671B", "DeepSeek-V3", None),
        ("deepseek_v3", "kimi_k2", "Kimi-K2-Instruct", None),
        ("llama4", "17bx16e_published", "Llama-4-Scout-17B-16E", None),
    ],
)
def test_a_published_config_json_loads_as_from_hf_and_as_its_named_flavor(
    tmp_path, family, flavor, published, total, caplog
):
    """The config.json files as the hub publishes them (tests/published_configs, values copied from the
    model cards' repositories) describe the named flavor's model; only a norm epsilon may differ, which
    the run takes from the checkpoint with one line."""
    folder = tmp_path / published
    folder.mkdir()
    shutil.copy(_PUBLISHED / f"{published}.json", folder / "config.json")
    hf_eps = json.loads((folder / "config.json").read_text())
    hf_eps = hf_eps.get("text_config", hf_eps)["rms_norm_eps"]
    # DeepSeek's named flavors switch YaRN on by the training length, as torchtitan's do (past the 4096
    # positions it was pretrained with); the published config computes it at every length.
    seq_len = "8192" if family == "deepseek_v3" else "64"
    plans = {}
    for name in ("from_hf", flavor):
        config = load_job_config(
            [
                *("--model.name", family, "--model.flavor", name, "--training.seq_len", seq_len),
                *("--job.dump_folder", str(tmp_path / "out"), "--model.hf_assets_path", str(folder)),
                *("--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
            ]
        )
        caplog.clear()
        with caplog.at_level(logging.INFO):
            plans[name] = resolve(config, 1, "cpu")
        taken = [r.getMessage() for r in caplog.records if "norm epsilon" in r.getMessage()]
        # torchtitan's 671B keeps its own 1e-5; kimi_k2 states the published 1e-6.
        assert len(taken) == (name == flavor and flavor == "671B"), taken
    assert plans["from_hf"].params == plans[flavor].params
    assert plans[flavor].model_args.norm_eps == plans["from_hf"].model_args.norm_eps == hf_eps
    if total is not None:  # the published parameter count
        assert plans[flavor].params.total == total

"""Qwen3.5 through `titan-train`: the debug flavor trains from the command line, packed block-causal rows
included, and its Hugging Face export reloads in transformers' `Qwen3_5ForCausalLM` with the trained
model's logits; what Titan does not build for the family is refused at the resolve step in one line."""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from titan_models import load_safetensors_sharded
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.wiring.data import BUNDLED_TOKENIZER

FLAGS = (
    *("--model.name", "qwen3_5", "--training.seq_len", "48"),
    *("--training.steps", "3", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "2"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
    *("--checkpoint.enable", "--checkpoint.last_save_in_hf"),
)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_flex_attn"])
def test_the_debug_flavor_trains_and_its_export_reloads_in_transformers_with_equal_logits(flavor, tmp_path):
    """The block-causal flavor packs documents; logits are compared on tokens without an end-of-text."""
    flags = ["--job.dump_folder", str(tmp_path), *FLAGS, "--model.flavor", flavor]
    assert run(flags) == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) for line in lines)
    folder = tmp_path / "checkpoint" / "step-3"
    trained = load_checkpoint_model(load_job_config(flags), folder, weights="dcp", device="cpu").model.eval()
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    eos = trained.args.eos_id
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens = torch.where(tokens == eos, eos + 1, tokens) if eos is not None else tokens
    with torch.no_grad():
        expected, got = hf(tokens).logits, trained(tokens)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(
    ("flavor", "flag", "match"),
    [
        (
            "debugmodel_flex_attn",
            "context_parallel_degree",
            r"context_parallel_degree\(2\): qwen3_5 debugmodel_flex_attn packs",
        ),
        (
            "debugmodel_moe",
            "tensor_parallel_degree",
            r"tensor_parallel_degree\(2\): model: qwen3_5 MoE flavors",
        ),
    ],
)
def test_layouts_titan_does_not_build_for_qwen3_5_are_refused_at_resolve_in_one_line(flavor, flag, match):
    """Context parallelism of packed rows, and tensor parallelism of the MoE flavors. Planted: `context_parallel_refusal`
    returning None lets cp 2 through to a silently wrong run."""
    config = load_job_config([*FLAGS, "--model.flavor", flavor, f"--parallelism.{flag}", "2"])
    with pytest.raises(ConfigError, match=match) as caught:
        resolve(config, 2, "cpu")
    assert "\n" not in str(caught.value)


def _image_text_folder(folder):
    """A transformers `Qwen3_5ForConditionalGeneration` folder as the Hub publishes one (`text_config` beside
    `vision_config`, text weights under `model.language_model.`, the tower under `model.visual.`), in bf16,
    random weights, with the bundled tokenizer."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from titan_models.qwen3_5 import Qwen3_5StateDictAdapter, qwen3_5_args

    text = Qwen3_5StateDictAdapter(replace(qwen3_5_args("debugmodel"), n_layers=4)).hf_config()
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"]
    )
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g) - (2.0 if name.endswith("A_log") else 0.0))
    model.to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder


def test_a_published_image_text_folder_trains_from_its_text_weights_and_exports_them_back(tmp_path, caplog):
    """`from_hf` reads `text_config`, Titan's streamed import (one block at a time) loads the text weights and
    says the tower is skipped; one step at lr 1e-9 exported in bf16 gives back every text tensor (to the 1e-9
    that step moves weights within a rounding step of zero), where weights not loaded would differ by ~0.1."""
    base = _image_text_folder(tmp_path / "base")
    dump = tmp_path / "run"
    flags = [
        *("--job.dump_folder", str(dump), "--model.name", "qwen3_5", "--model.flavor", "from_hf"),
        *("--model.hf_assets_path", str(base), "--training.steps", "1", "--optimizer.lr", "1e-9"),
        *("--training.seq_len", "48", "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "0"),
        *("--activation_checkpoint.mode", "none", "--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
        "--checkpoint.last_save_in_hf",
    ]  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert run(flags) == 0
    assert "vision tower" in caplog.text and "model.visual." in caplog.text
    original = load_safetensors_sharded(base)
    text = {
        "model." + k.removeprefix("model.language_model."): t
        for k, t in original.items()
        if k.startswith("model.language_model.") or k == "lm_head.weight"
    }
    exported = load_safetensors_sharded(dump / "checkpoint" / "step-1")
    assert exported.keys() == {"lm_head.weight" if k == "model.lm_head.weight" else k for k in text}
    for name, tensor in text.items():
        name = "lm_head.weight" if name == "model.lm_head.weight" else name
        assert exported[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(exported[name], tensor, atol=1e-8, rtol=0)

"""Qwen3.5 through `titan-train`: the debug flavor trains from the command line, packed block-causal rows
included, and its Hugging Face export reloads in transformers' `Qwen3_5ForCausalLM` with the trained
model's logits; what Titan does not build for the family is refused at the resolve step in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve

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
    ("flag", "degree", "match"),
    [
        (
            "context_parallel_degree",
            2,
            r"context_parallel_degree\(2\): qwen3_5 debugmodel has Gated DeltaNet",
        ),
        (
            "tensor_parallel_degree",
            2,
            r"tensor_parallel_degree\(2\): model: qwen3_5 has no tensor-parallel plan",
        ),
    ],
)
def test_layouts_titan_does_not_build_for_qwen3_5_are_refused_at_resolve_in_one_line(flag, degree, match):
    """Planted: `context_parallel_refusal` returning None lets cp 2 through to a silently wrong run."""
    config = load_job_config([*FLAGS, "--model.flavor", "debugmodel", f"--parallelism.{flag}", str(degree)])
    with pytest.raises(ConfigError, match=match) as caught:
        resolve(config, 2, "cpu")
    assert "\n" not in str(caught.value)

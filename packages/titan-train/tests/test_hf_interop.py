"""Hugging Face checkpoints through the trainer: a config.json that differs from the flavor is refused,
`from_hf` trains the checkpoint's own shape, and an export loads with AutoModelForCausalLM and
AutoTokenizer as it is. The checkpoint is built here with transformers (nothing downloaded)."""

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from titan_models import llama3_args, to_hf_config
from titan_train.cli import run
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

TEXT = "Return the number of items in a container, as the documentation says."


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """The debug model's shape with Llama 3.2's rotary stretch (factor 32, not the flavor's 8), random
    weights, saved by transformers with the bundled tokenizer's files, as a hub folder holds them."""
    folder = tmp_path_factory.mktemp("hf")
    args = llama3_args("debugmodel")
    args = replace(args, rope_scaling=replace(args.rope_scaling, factor=32.0))
    # The token ids of the tokenizer saved beside it, as a published folder states them (an export keeps them).
    config = LlamaConfig(
        **{**to_hf_config(args), "max_position_embeddings": 4096, "bos_token_id": 1792, "eos_token_id": 1793}
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn(p.shape))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder, model


def _flags(folder, *more):
    return (
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
        "--model.hf_assets_path",
        str(folder),
        *more,
    )


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))


def test_a_checkpoint_whose_rope_scaling_differs_from_the_flavor_is_refused_naming_it(
    tmp_path, hf_checkpoint, caplog
):
    folder, _ = hf_checkpoint
    argv = ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", *_flags(folder)]
    with caplog.at_level(logging.ERROR):
        assert run(argv) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == (
        f"config: the Hugging Face checkpoint in {folder} is not llama3 debugmodel: rope_scaling.factor: "
        "checkpoint 32.0, flavor 8.0; set model.flavor = 'from_hf' to train the checkpoint's own shape, or pick "
        "the flavor it was trained as"
    )
    assert not (tmp_path / "checkpoint").exists()


def test_the_dry_run_traces_the_memory_of_a_from_hf_model(tmp_path, hf_checkpoint, caplog):
    """The memory estimate builds the checkpoint's own shape, as training does (before any process group:
    the trace makes its own)."""
    folder, hf = hf_checkpoint
    argv = [
        "dry-run",
        "--ngpu",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "32",
        *_flags(folder, "--model.flavor", "from_hf"),
    ]
    with caplog.at_level(logging.INFO):
        assert run(argv) == 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"blocks of {sum(p.numel() for p in hf.model.layers[0].parameters()):,}" in text
    assert "memory per rank, traced" in text and "peak allocated" in text


def test_from_hf_computes_transformers_logits_and_its_export_loads_with_auto_classes(
    tmp_path, hf_checkpoint, small_config, one_rank
):
    folder, hf = hf_checkpoint
    tokens = _tokens(hf.config.vocab_size)
    load = small_config(
        tmp_path / "load", *_flags(folder, "--model.flavor", "from_hf", "--training.steps", "0")
    )
    loaded = Trainer(resolve(load, 1, "cpu"), one_rank)
    loaded.train()
    assert loaded.model_parts[0].args.rope_scaling.factor == 32.0
    with torch.no_grad():
        expected = hf(tokens).logits
        assert (loaded.model_parts[0].eval()(tokens) - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5

    run = small_config(
        tmp_path / "run",
        *_flags(folder, "--model.flavor", "from_hf", "--training.steps", "1", "--checkpoint.last_save_in_hf"),
    )
    trained = Trainer(resolve(run, 1, "cpu"), one_rank)
    trained.train()
    export = tmp_path / "run" / "checkpoint" / "step-1"
    config = json.loads((export / "config.json").read_text())
    titan_tokenizer = trained.tokenizer
    assert (config["max_position_embeddings"], config["rope_scaling"]["factor"], config["torch_dtype"]) == (
        4096,
        32.0,
        "float32",
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        titan_tokenizer.bos_id,
        titan_tokenizer.eos_id,
    )
    generation = GenerationConfig.from_pretrained(export)
    assert (generation.bos_token_id, generation.eos_token_id) == (
        titan_tokenizer.bos_id,
        titan_tokenizer.eos_id,
    )

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = trained.model_parts[0].eval()(tokens)
        assert (model(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (ours - expected).abs().max().item() > 1e-3  # the step changed the weights
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == titan_tokenizer.encode(TEXT)
    assert tokenizer.decode(titan_tokenizer.encode(TEXT)) == TEXT


def test_a_flavor_export_states_the_flavor_s_context_not_the_training_length(
    tmp_path, small_config, one_rank
):
    config = small_config(
        tmp_path, "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--training.steps", "1"
    )
    Trainer(resolve(config, 1, "cpu"), one_rank).train()
    config = json.loads((tmp_path / "checkpoint" / "step-1" / "config.json").read_text())
    assert config["max_position_embeddings"] == 131_072  # trained at seq_len 32
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert AutoTokenizer.from_pretrained(tmp_path / "checkpoint" / "step-1").eos_token == "<|end_of_text|>"


def test_an_export_hugging_face_cannot_compute_is_refused_before_step_1(tmp_path, caplog):
    """The DeepSeek debug flavor routes with softmax; DeepseekV3ForCausalLM only with sigmoid."""
    config = Path(__file__).parents[3] / "apps" / "configs" / "deepseek_v3_debug.toml"
    argv = [
        "--job.config_file",
        str(config),
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
    ]
    with caplog.at_level(logging.INFO):
        assert run(argv) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("config: checkpoint.last_save_in_hf cannot export deepseek_v3 debugmodel: ")
    assert "moe.score_func 'softmax'" in line and "\n" not in line
    assert not any("step:" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "tb").exists()

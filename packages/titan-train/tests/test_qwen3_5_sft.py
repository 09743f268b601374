"""Chat SFT of a Qwen3.5 saved by transformers, through the trainer: the step-one loss of packed rows (the
linear layers restarting at every conversation) and of padded ones equals transformers' on the chat
template's ids, and a LoRA run's PEFT adapter on transformers' base gives the trained model's logits."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from peft import PeftModel
from test_sft import _conversation, _expected_loss, _write
from tiny_qwen3_5 import random_text_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER
from titan_train.wiring.lora_export import PEFT_FOLDER


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A 4-block Qwen3.5 (3 linear, 1 full) with random weights, saved with the bundled tokenizer and template."""
    folder = tmp_path_factory.mktemp("qwen3_5_chat")
    model = random_text_model(seed=0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder, model, AutoTokenizer.from_pretrained(folder)


def _flags(folder, data, dump, *more):
    return [
        *("--job.dump_folder", str(dump), "--model.name", "qwen3_5", "--model.flavor", "from_hf"),
        *("--model.hf_assets_path", str(folder), "--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
        *("--checkpoint.interval", "1000", "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
        *("--lr_scheduler.warmup_steps", "0", "--training.dataset", "chat", "--training.dataset_path", str(data)),
        *("--training.seq_len", "256", "--optimizer.lr", "1e-2", *more),
    ]  # fmt: skip


def test_step_one_loss_equals_transformers_on_the_chat_template_packed_and_padded(
    tmp_path, chat_model, one_rank
):
    """Planted: the delta-rule state not emptied where a packed conversation starts fails the packed run."""
    folder, model, tokenizer = chat_model
    rng = random.Random(1)
    conversations = [_conversation(rng, turns, 4) for turns in (1, 2, 3, 2, 3, 1)]
    data = _write(tmp_path / "chat.jsonl", conversations)
    expected = _expected_loss(model.eval(), tokenizer, conversations, "assistant")
    for packing, rows in (("true", 3), ("false", len(conversations))):
        flags = _flags(folder, data, tmp_path / f"run_{packing}", "--training.steps", "1")
        more = (
            "--training.local_batch_size",
            str(rows),
            "--sft.loss_on",
            "assistant",
            "--sft.packing",
            packing,
        )
        trainer = Trainer(resolve(load_job_config([*flags, *more]), 1, "cpu"), one_rank)
        (loss,) = trainer.train()
        assert loss == pytest.approx(expected, abs=1e-5), packing


def test_lora_sft_ends_in_a_peft_adapter_that_gives_the_trained_logits(tmp_path, chat_model, one_rank):
    folder, _, _ = chat_model
    rng = random.Random(4)
    data = _write(tmp_path / "chat.jsonl", [_conversation(rng, rng.randint(1, 3), 4) for _ in range(8)])
    lora = ("--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "4")
    flags = [
        *_flags(folder, data, tmp_path / "run", "--training.steps", "3", "--training.local_batch_size", "2"),
        *lora,
        "--checkpoint.last_save_in_hf",
    ]
    Trainer(resolve(load_job_config(flags), 1, "cpu"), one_rank).train()
    export = tmp_path / "run" / "checkpoint" / "step-3"
    trained = load_checkpoint_model(load_job_config(flags), export, weights="dcp", device="cpu").model.eval()
    base = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    peft_model = PeftModel.from_pretrained(base, export / PEFT_FOLDER).eval()
    adapted_modules = {n.rsplit(".", 2)[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert any("linear_attn.in_proj_qkv" in n for n in adapted_modules)
    assert any("self_attn.q_proj" in n for n in adapted_modules)
    tokens = torch.randint(3, 2000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, expected = trained(tokens), peft_model(input_ids=tokens).logits
        with peft_model.disable_adapter():
            assert (expected - peft_model(input_ids=tokens).logits).abs().max() > 1e-4  # the adapters trained
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5

"""Supervised fine-tuning through the trainer, against transformers: a Llama built and saved here with
transformers (nothing downloaded), the bundled tokenizer with its chat template, chat rows in a JSONL
file. The expected loss is transformers' model on `tokenizer.apply_chat_template` ids, with the
assistant spans found in the test by scanning for the template's header and end-of-turn tokens."""

import json
import random
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from tiny_llama import from_hf_flags, save_tiny_llama
from transformers import AutoTokenizer, LlamaForCausalLM

from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER
from titan_train.wiring.lora_export import PEFT_FOLDER

WORDS = "alpha river stone quick blue seven garden lamp north paper music cloud orange table winter".split()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A 2-layer Llama with random weights (norms too), saved with the bundled tokenizer and template."""
    folder = tmp_path_factory.mktemp("chat_model")
    model = save_tiny_llama(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder, model, AutoTokenizer.from_pretrained(folder)


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversation(rng, turns, words):
    messages = [{"role": "system", "content": "You answer briefly. " + _sentence(rng, 3)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": _sentence(rng, rng.randint(2, words))})
        messages.append({"role": "assistant", "content": _sentence(rng, rng.randint(2, words))})
    return messages


def _write(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def _flags(folder, data, dump, *more):
    return (
        *from_hf_flags(folder, dump),
        "--training.dataset", "chat",
        "--training.dataset_path", str(data),
        "--training.seq_len", "256",
        "--optimizer.lr", "1e-2",
        *more,
    )  # fmt: skip


def _assistant_spans(ids, tokenizer, last_only):
    """Targets by scanning: after each '<|start_header_id|>assistant<|end_header_id|>\\n\\n' up to and
    including the next '<|eot_id|>'."""
    header = tokenizer.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    spans, i = [], 0
    while i < len(ids):
        if ids[i : i + len(header)] == header:
            start = i + len(header)
            end = ids.index(eot, start) + 1
            spans.append((start, end))
            i = end
        else:
            i += 1
    assert spans
    return spans[-1:] if last_only else spans


def _expected_loss(model, tokenizer, conversations, loss_on):
    total, count = 0.0, 0
    for messages in conversations:
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        trained = torch.zeros(len(ids), dtype=torch.bool)
        if loss_on == "all":
            trained[:] = True
        else:
            for start, end in _assistant_spans(ids, tokenizer, loss_on == "last"):
                trained[start:end] = True
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        total += losses[trained[1:]].sum().item()
        count += int(trained[1:].sum())
    return total / count


@pytest.mark.parametrize("loss_on", ["assistant", "last", "all"])
def test_step_one_loss_equals_transformers_on_the_chat_template_packed_and_padded(
    tmp_path, chat_model, one_rank, loss_on
):
    folder, model, tokenizer = chat_model
    rng = random.Random(1)
    conversations = [_conversation(rng, turns, 4) for turns in (1, 2, 3, 2, 3, 1)]
    data = _write(tmp_path / "chat.jsonl", conversations)
    expected = _expected_loss(model, tokenizer, conversations, loss_on)
    for packing, rows in (("true", 3), ("false", len(conversations))):
        flags = _flags(folder, data, tmp_path / f"run_{packing}", "--training.steps", "1")
        more = ("--training.local_batch_size", str(rows), "--sft.loss_on", loss_on, "--sft.packing", packing)
        trainer = Trainer(resolve(load_job_config([*flags, *more]), 1, "cpu"), one_rank)
        (loss,) = trainer.train()
        assert loss == pytest.approx(expected, abs=1e-5), (packing, loss_on)


def _metrics(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_packing_is_invisible_same_losses_grad_norms_and_weights_as_padding(tmp_path, chat_model, one_rank):
    """Conversations of 86 to 128 positions: a packed row of 256 holds exactly two, so 2 packed rows and 4
    padded rows carry the same conversations each step."""
    folder, _, tokenizer = chat_model
    rng, conversations = random.Random(2), []
    while len(conversations) < 12:
        messages = _conversation(rng, rng.randint(2, 3), 6)
        n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if 86 <= n - 1 <= 128:
            conversations.append(messages)
    data = _write(tmp_path / "chat.jsonl", conversations)
    trainers = {}
    for packing, rows in (("true", 2), ("false", 4)):
        flags = _flags(folder, data, tmp_path / packing, "--training.steps", "3", "--sft.packing", packing)
        # lr 1e-3: Adam turns a 1e-9 gradient difference on a near-zero gradient into up to lr per step
        config = load_job_config([*flags, "--training.local_batch_size", str(rows), "--optimizer.lr", "1e-3"])
        trainers[packing] = Trainer(resolve(config, 1, "cpu"), one_rank)
        trainers[packing].train()
    packed, padded = _metrics(tmp_path / "true"), _metrics(tmp_path / "false")
    assert len({r["loss"] for r in packed}) == 3  # three different steps
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in packed] == pytest.approx([r[key] for r in padded], abs=1e-5), key
    weights = {k: v.state_dict() for k, v in ((k, t.model_parts[0]) for k, t in trainers.items())}
    for name, value in weights["true"].items():
        assert (value - weights["false"][name]).abs().max().item() <= 1e-5, name
    initial = LlamaForCausalLM.from_pretrained(folder).state_dict()["model.norm.weight"]
    moved = (weights["true"]["norm.weight"] - initial).abs().max().item()
    assert moved > 1e-4  # the steps changed the weights being compared


def test_a_run_stopped_mid_epoch_resumes_with_the_same_batches_and_losses(tmp_path, chat_model, one_rank):
    """A 4-step run saving every 2 steps; a copy of its folder without step-4 is a run killed after
    step 2: resumed, the data position (packer state included) and the weights come back, so steps 3
    and 4 log the same losses. 24 conversations in rows of 2: the stop falls mid-epoch."""
    folder, _, _ = chat_model
    rng = random.Random(3)
    data = _write(tmp_path / "chat.jsonl", [_conversation(rng, rng.randint(1, 3), 4) for _ in range(24)])

    def run(dump):
        flags = _flags(folder, data, dump, "--training.steps", "4", "--training.local_batch_size", "2")
        config = load_job_config([*flags, "--checkpoint.interval", "2", "--training.seq_len", "128"])
        return Trainer(resolve(config, 1, "cpu"), one_rank).train()

    straight = run(tmp_path / "straight")
    assert len(set(straight)) == 4
    shutil.copytree(
        tmp_path / "straight" / "checkpoint" / "step-2", tmp_path / "killed" / "checkpoint" / "step-2"
    )
    resumed = run(tmp_path / "killed")  # finds checkpoint/step-2: steps 3 and 4 only
    assert resumed == pytest.approx(straight[2:], abs=1e-6)


def _generated(out: str, prompts: list[str]) -> list[tuple[str, int, str]]:
    """(finish reason, new tokens, text) per prompt, as `titan-train generate` prints them."""
    blocks = re.split(r"^--- prompt \d+ \((\w+), (\d+) tokens\)\n", out, flags=re.M)[1:]
    texts = [blocks[3 * i + 2].split("\ngenerated ")[0].removesuffix("\n") for i in range(len(prompts))]
    assert all(text.startswith(p) for text, p in zip(texts, prompts, strict=True))
    return [
        (blocks[3 * i], int(blocks[3 * i + 1]), t[len(p) :])
        for i, (t, p) in enumerate(zip(texts, prompts, strict=True))
    ]


def test_sft_with_lora_from_a_transformers_checkpoint_ends_in_a_peft_adapter_that_generates_titans_text(
    tmp_path, chat_model, one_rank, capsys
):
    """Chat SFT with LoRA adapters on every linear layer of a model saved by transformers; the last save's
    PEFT folder, on transformers' base model, generates greedily what `titan-train generate --chat` does
    with the run's own checkpoint (adapters unmerged), token for token, under the chat template."""
    folder, _, tokenizer = chat_model
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

    prompts = ["What is alpha river?", "Say seven garden lamp"]
    argv = ["generate", "--checkpoint", str(export), "--weights", "dcp", "--chat", "--max-new-tokens", "12"]
    capsys.readouterr()
    assert run([*argv, *(a for p in prompts for a in ("--prompt", p)), *flags]) == 0
    titan = _generated(capsys.readouterr().out, prompts)

    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, export / PEFT_FOLDER).eval()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for (reason, count, text), prompt in zip(titan, prompts, strict=True):
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        with torch.no_grad():
            out = peft_model.generate(
                input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=end_of_turn
            )
            adapted = peft_model(input_ids=ids).logits
            with peft_model.disable_adapter():
                assert (adapted - peft_model(input_ids=ids).logits).abs().max() > 1e-4  # the adapters trained
        new = out[0, ids.shape[1] :].tolist()
        if new[-1] == end_of_turn:
            new = new[:-1]
            assert reason == "eos"
        assert (count, text) == (len(new), tokenizer.decode(new)), prompt


def test_validation_on_a_chat_split_is_transformers_loss_with_the_same_masks(tmp_path, chat_model, one_rank):
    """`validation.dataset = "chat"` on its own file, with `sft.loss_on = "last"`: after one training step,
    the validation loss equals transformers' on the step's exported weights over the held-out conversations,
    with the last assistant turn masked in by the test itself."""
    folder, _, tokenizer = chat_model
    rng = random.Random(5)
    train = _write(tmp_path / "train.jsonl", [_conversation(rng, rng.randint(1, 3), 4) for _ in range(4)])
    held_out = [_conversation(rng, turns, 4) for turns in (2, 3, 1)]
    validation = _write(tmp_path / "validation.jsonl", held_out)
    flags = _flags(
        folder, train, tmp_path / "run", "--training.steps", "1", "--training.local_batch_size", "2"
    )
    more = (
        "--sft.loss_on", "last",
        "--sft.packing", "false",  # one held-out conversation a row: the 3 rows are one validation batch
        "--checkpoint.last_save_in_hf",
        "--validation.enable",
        "--validation.dataset", "chat",
        "--validation.dataset_path", str(validation),
        "--validation.seq_len", "256",
        "--validation.local_batch_size", "3",
        "--validation.freq", "1",
        "--validation.steps", "1",
    )  # fmt: skip
    Trainer(resolve(load_job_config([*flags, *more]), 1, "cpu"), one_rank).train()
    (record,) = [
        json.loads(line) for line in (tmp_path / "run" / "validation.jsonl").read_text().splitlines()
    ]
    trained = LlamaForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint" / "step-1").eval()
    assert record["loss"] == pytest.approx(_expected_loss(trained, tokenizer, held_out, "last"), abs=1e-5)

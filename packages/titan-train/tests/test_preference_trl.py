"""Preference tuning against TRL step by step: a tiny Llama saved by transformers here (nothing
downloaded), the bundled tokenizer with two reserved tokens renamed to ChatML's <|im_start|> and
<|im_end|> and a ChatML template, six conversational pairs, full batch, constant lr, no weight decay.
TRL's DPOTrainer (sigmoid, ipo, hinge, sigmoid + sft as RPO) trains the same model on the same rows; every
step's loss, grad_norm and reward metrics must agree within 1e-4 relative. SimPO and ORPO are checked
the same way against TRL's CPOTrainer(loss_type="simpo") and ORPOTrainer (trl.experimental in TRL 1.16),
end to end and on their loss methods; those trainers tokenise the prompt and completion strings
themselves and add the tokenizer's EOS where a completion does not end with it, so on their side the
EOS is ChatML's <|im_end|> (already there) and there is no BOS (the template writes none). Validation on
held-out pairs is checked against DPOTrainer's evaluation (eval_loss and the eval_ metrics)."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from tiny_llama import from_hf_flags, save_tiny_llama

from titan_train.config import load_job_config
from titan_train.objectives.preference_loss import SequenceLogps, pair_losses
from titan_train.objectives.preference_step import METRICS
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

WORDS = "alpha river stone quick blue seven garden lamp north paper music cloud orange table winter".split()
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{%- if not loop.last or add_generation_prompt %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STEPS, LR = 6, 1e-3


def chatml_model(folder):
    """A 2-layer Llama with random weights and a ChatML tokenizer, saved by transformers in `folder`."""
    save_tiny_llama(folder)
    renames = {"<|reserved_special_token_0|>": "<|im_start|>", "<|reserved_special_token_1|>": "<|im_end|>"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (BUNDLED_TOKENIZER / name).read_text()
        for old, new in renames.items():
            text = text.replace(old, new)
        (folder / name).write_text(text)
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return chatml_model(tmp_path_factory.mktemp("chatml_model"))


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def preference_rows(count=6, seed=1):
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = [{"role": "user", "content": _sentence(rng, rng.randint(3, 8))}]
        chosen = [{"role": "assistant", "content": _sentence(rng, rng.randint(2, 9))}]
        rejected = [{"role": "assistant", "content": _sentence(rng, rng.randint(2, 9))}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def titan_flags(folder, data, dump, pairs, *more):
    return (
        *from_hf_flags(folder, dump),
        "--training.dataset", "preference",
        "--training.dataset_path", str(data),
        "--training.seq_len", "64",
        "--training.local_batch_size", str(pairs),
        "--training.steps", str(STEPS),
        "--sft.packing", "false",
        "--lr_scheduler.decay_ratio", "0",
        "--optimizer.lr", str(LR),
        "--optimizer.weight_decay", "0",
        "--optimizer.beta2", "0.999",
        "--optimizer.implementation", "foreach",
        *more,
    )  # fmt: skip


def titan_run(folder, tmp_path, info, name, rows, *more):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dump = tmp_path / name
    config = load_job_config(list(titan_flags(folder, data, dump, len(rows), *more)))
    Trainer(resolve(config, 1, "cpu"), info).train()
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _trainer_args(tmp_path, name, rows):
    """What each TRL trainer here is given: the rows as one batch, a constant lr, AdamW without decay."""
    return dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=len(rows),
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )


def _train(trainer_class, args, folder, tokenizer, rows, eval_rows=None):
    """TRL's trainer on `rows`; its training and evaluation logs, each with its step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    logs = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and ("loss" in logs or "eval_loss" in logs):
                kept.append(dict(logs, step=state.global_step))

    kept = logs
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=tokenizer,
        callbacks=[Keep()],
    )
    trainer.train()
    return logs


def trl_run(folder, tmp_path, rows, loss_type, loss_weights=None, eval_rows=None, eval_steps=None):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    evaluation = {}
    if eval_rows:
        evaluation = {
            "eval_strategy": "steps",
            "eval_steps": eval_steps,
            "per_device_eval_batch_size": len(eval_rows),
        }
    args = DPOConfig(
        **_trainer_args(tmp_path, "trl", rows),
        beta=0.1,
        loss_type=loss_type,
        loss_weights=loss_weights,
        max_length=None,
        dataset_num_proc=None,
        **evaluation,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token or "<|end_of_text|>"
    return _train(DPOTrainer, args, folder, tokenizer, rows, eval_rows)


def trl_reference_free_run(folder, tmp_path, rows, trainer_name, **options):
    """`CPOTrainer` or `ORPOTrainer` (trl.experimental) on the same rows, model and optimizer as titan_run."""
    from transformers import AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config_class, trainer_class = {"cpo": (CPOConfig, CPOTrainer), "orpo": (ORPOConfig, ORPOTrainer)}[
        trainer_name
    ]
    args = config_class(**_trainer_args(tmp_path, trainer_name, rows), **options)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = "<|im_end|>"  # ends every ChatML turn: CPO/ORPO then add no EOS of their own
    tokenizer.bos_token = None  # the ChatML template writes none, so neither does Titan
    tokenizer.pad_token = "<|end_of_text|>"
    return _train(trainer_class, args, folder, tokenizer, rows)


@pytest.mark.parametrize(
    "loss, trainer_name, options, more",
    [
        (
            "simpo",
            "cpo",
            {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.7, "label_smoothing": 0.1},
            (
                "--preference.beta",
                "2.0",
                "--preference.simpo_gamma",
                "0.7",
                "--preference.label_smoothing",
                "0.1",
            ),
        ),
        ("orpo", "orpo", {"beta": 0.25}, ("--preference.beta", "0.25")),
    ],
)
def test_every_step_equals_trls_cpo_and_orpo_trainers(
    tmp_path, model_folder, one_rank, loss, trainer_name, options, more
):
    rows = preference_rows()
    titan = titan_run(model_folder, tmp_path, one_rank, loss, rows, "--preference.loss", loss, *more)
    theirs = trl_reference_free_run(model_folder, tmp_path, rows, trainer_name, **options)
    assert len(titan) == len(theirs) == STEPS
    for step, (ours, ref) in enumerate(zip(titan, theirs, strict=True), 1):
        for key in ("loss", "grad_norm", *METRICS):
            assert _close(ours[key], ref[key]), (loss, step, key, ours[key], ref[key])
    assert titan[-1]["loss"] != titan[0]["loss"]  # it trained


def _close(a, b, rel=1e-4, floor=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


@pytest.mark.parametrize(
    "loss, trl_loss, weights, more",
    [
        ("sigmoid", ["sigmoid"], None, ()),
        ("ipo", ["ipo"], None, ()),
        ("hinge", ["hinge"], None, ()),
        ("rpo", ["sigmoid", "sft"], [1.0, 0.5], ("--preference.rpo_alpha", "0.5")),
    ],
)
def test_every_step_equals_trls_dpo_trainer(tmp_path, model_folder, one_rank, loss, trl_loss, weights, more):
    rows = preference_rows()
    kind = "sigmoid" if loss == "rpo" else loss
    titan = titan_run(
        model_folder,
        tmp_path,
        one_rank,
        loss,
        rows,
        "--preference.loss",
        kind,
        "--preference.beta",
        "0.1",
        *more,
    )
    theirs = [log for log in trl_run(model_folder, tmp_path, rows, trl_loss, weights) if "loss" in log]
    assert len(titan) == len(theirs) == STEPS
    for step, (ours, ref) in enumerate(zip(titan, theirs, strict=True), 1):
        for key in ("loss", "grad_norm", *METRICS):
            assert _close(ours[key], ref[key]), (loss, step, key, ours[key], ref[key])
    assert titan[-1]["loss"] != titan[0]["loss"]  # it trained


def _logps(chosen, rejected, n_chosen, n_rejected):
    sums = torch.stack([chosen, rejected], 1).reshape(-1)
    counts = torch.stack([n_chosen, n_rejected], 1).reshape(-1)
    return SequenceLogps(sums, counts)


def test_simpo_and_orpo_equal_trls_cpo_and_orpo_losses():
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(0)
    n_c, n_r = (
        torch.randint(3, 20, (5,), generator=g).float(),
        torch.randint(3, 20, (5,), generator=g).float(),
    )
    s_c, s_r = -torch.rand(5, generator=g) * n_c * 2, -torch.rand(5, generator=g) * n_r * 2
    policy = _logps(s_c, s_r, n_c, n_r)
    device = SimpleNamespace(device=torch.device("cpu"))
    for smoothing in (0.0, 0.1):
        cpo = SimpleNamespace(
            alpha=0.0,
            loss_type="simpo",
            beta=2.0,
            simpo_gamma=0.7,
            label_smoothing=smoothing,
            accelerator=device,
        )
        theirs, their_c, their_r = CPOTrainer.cpo_loss(cpo, s_c / n_c, s_r / n_r)
        ours = pair_losses("simpo", policy, None, beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
        torch.testing.assert_close(ours.losses, theirs, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours.chosen_rewards, their_c)
        torch.testing.assert_close(ours.rejected_rewards, their_r)
    orpo = SimpleNamespace(beta=0.25, accelerator=device)
    theirs, their_c, their_r, _, _ = ORPOTrainer.odds_ratio_loss(orpo, s_c / n_c, s_r / n_r)
    ours = pair_losses("orpo", policy, None, beta=0.25)
    torch.testing.assert_close(ours.losses, -theirs, rtol=1e-6, atol=0)  # ORPO's loss is nll - mean(theirs)
    torch.testing.assert_close(ours.chosen_rewards, their_c)
    assert not math.isnan(float(ours.losses.sum()))


def test_validation_on_held_out_pairs_equals_trls_evaluation(tmp_path, model_folder, one_rank):
    """Held-out pairs scored every 3 steps: the loss and the six metrics equal TRL's eval_ logs (its
    DPOTrainer evaluating the whole held-out set as one batch) at steps 3 and 6. Sigmoid only: the
    losses' formulas are the training tests'; this one checks what validation adds (the held-out
    windows, the reference, the reduction over pairs, the names)."""
    loss = "sigmoid"
    rows, held_out = preference_rows(), preference_rows(count=4, seed=2)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in held_out))
    flags = ("--preference.loss", loss, "--validation.enable", "--validation.dataset", "preference")
    flags += ("--validation.dataset_path", str(data), "--validation.freq", "3", "--validation.steps", "-1")
    flags += ("--validation.local_batch_size", str(len(held_out)), "--validation.seq_len", "64")
    titan_run(model_folder, tmp_path, one_rank, "titan", rows, *flags)
    ours = [json.loads(line) for line in (tmp_path / "titan" / "validation.jsonl").read_text().splitlines()]
    logs = trl_run(model_folder, tmp_path, rows, [loss], eval_rows=held_out, eval_steps=3)
    theirs = [log for log in logs if "eval_loss" in log]
    assert [o["step"] for o in ours] == [t["step"] for t in theirs] == [3, 6]
    for mine, ref in zip(ours, theirs, strict=True):
        for key in ("loss", *METRICS):
            assert _close(mine[key], ref[f"eval_{key}"]), (
                loss,
                mine["step"],
                key,
                mine[key],
                ref[f"eval_{key}"],
            )
    assert ours[0]["loss"] != ours[1]["loss"]

"""GRPO end to end against TRL 1.16's GRPOTrainer, on the rollouts TRL generated (issue 59).

A tiny Llama saved by transformers with the BOS-less ChatML tokenizer of test_preference_trl, eight
conversational prompts, two reward functions (grpo_rewards: a vowel share and a length target that abstains
on rows without a hint) with weights 1 and 0.5. TRL's GRPOTrainer trains STEPS steps, sampling with
transformers' generate; a subclass records every step's prompt and completion ids as Titan's rollout lines.
Titan replays them (`grpo.replay_rollouts`) from the same starting weights with the same optimizer: its
prompts must render to TRL's ids (the replay checks it), and every step's loss, grad_norm, reward metrics,
entropy, clip ratios and (beta > 0) kl must equal TRL's within 1e-4 relative, for each loss type, for GSPO,
and for grpo with num_iterations 2 (step 2 trains again on step 1's rollouts against the generating
policy's log-probs: its ratios leave 1 and clip at epsilon 0.02).

Planted once each (2026-12-02): advantages not divided by the group's std fails every case at step 1's
grad_norm; the KL's sign flipped (ref - logp -> logp - ref) fails dapo-beta's kl; dapo normalised per
sequence (grpo's reduction) fails dapo's loss; the reused step taking the current policy as the old one
fails grpo-mu2's step-2 loss (0.049 against 0.0063).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_preference_trl import WORDS, _trainer_args, chatml_model
from tiny_llama import from_hf_flags

from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer

trl = pytest.importorskip("trl")

STEPS, LR, B, G, COMPLETION = 3, 1e-3, 8, 4, 12
WEIGHTS = (1.0, 0.5)
METRICS = (
    "reward",
    "reward_std",
    "rewards/vowel_share/mean",
    "rewards/hint_length/mean",
    "frac_reward_zero_std",
    "entropy",
    "completions/mean_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
)
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The ChatML model, its generation config ending a completion at any of 300 ids: with random weights,
    about one token in ten, so completions of a group differ in length (per-token and per-sequence
    reductions then differ)."""
    folder = chatml_model(tmp_path_factory.mktemp("grpo_chatml"))
    path = folder / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, "eos_token_id": list(range(100, 400))}))
    return folder


def prompt_rows(count=8, seed=3):
    rng = random.Random(seed)
    rows = []
    for k in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))
        rows.append({"prompt": [{"role": "user", "content": text}], "hint": None if k % 3 == 0 else 4 + k})
    return rows


def trl_run(folder, tmp_path, rows, num_iterations=1, **options):
    """TRL's GRPOTrainer on `rows`; its logs per step and the rollouts it generated, as Titan's lines."""
    import grpo_rewards
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    recorded, logs = [], []

    class Recording(GRPOTrainer):
        def _generate(self, prompts):
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            step = self.state.global_step + 1
            generation = (step - 1) // num_iterations  # the batches TRL has generated before this one
            for k, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
                index = (generation * (B // G) + k // G) % len(rows)
                recorded.append(
                    {"step": step, "prompt_index": index, "prompt_ids": list(p), "completion_ids": list(c)}
                )
            return out

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                kept.append(dict(logs, step=state.global_step))

    kept = logs
    args = GRPOConfig(
        **{**_trainer_args(tmp_path, "trl", rows), "per_device_train_batch_size": B, "max_steps": STEPS},
        num_generations=G,
        max_completion_length=COMPLETION,
        shuffle_dataset=False,
        reward_weights=list(WEIGHTS),
        num_iterations=num_iterations,
        **options,
    )
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = "<|end_of_text|>"
    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        reward_funcs=[grpo_rewards.vowel_share, grpo_rewards.hint_length],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Keep()],
    )
    trainer.train()
    return logs, recorded


def titan_run(folder, tmp_path, info, rows, rollouts, *more):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay = tmp_path / "trl_rollouts.jsonl"
    replay.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    dump = tmp_path / "titan"
    flags = [
        *from_hf_flags(folder, dump),
        "--training.dataset", "prompts",
        "--training.dataset_path", str(data),
        "--training.seq_len", "96",
        "--training.local_batch_size", str(B),
        "--training.steps", str(STEPS),
        "--grpo.num_generations", str(G),
        "--grpo.max_prompt_length", "48",
        "--grpo.max_completion_length", str(COMPLETION),
        "--grpo.reward_funcs", "grpo_rewards:vowel_share,grpo_rewards:hint_length",
        "--grpo.reward_weights", ",".join(map(str, WEIGHTS)),
        "--grpo.replay_rollouts", str(replay),
        "--lr_scheduler.decay_ratio", "0",
        "--optimizer.lr", str(LR),
        "--optimizer.weight_decay", "0",
        "--optimizer.beta2", "0.999",
        "--optimizer.implementation", "foreach",
        *more,
    ]  # fmt: skip
    Trainer(resolve(load_job_config(flags), 1, "cpu"), info).train()
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _close(a, b, rel=1e-4, floor=1e-6):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


CASES = {
    "dapo-beta": ({"loss_type": "dapo", "beta": 0.04}, ("--grpo.loss_type", "dapo", "--grpo.beta", "0.04")),
    "grpo": ({"loss_type": "grpo"}, ("--grpo.loss_type", "grpo")),
    "dr_grpo": ({"loss_type": "dr_grpo", "scale_rewards": "none"}, ("--grpo.loss_type", "dr_grpo", "--grpo.scale_rewards", "none")),
    "bnpo": ({"loss_type": "bnpo", "scale_rewards": "batch"}, ("--grpo.loss_type", "bnpo", "--grpo.scale_rewards", "batch")),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 4.0}, ("--grpo.loss_type", "cispo", "--grpo.epsilon_high", "4.0")),
    "grpo-mu2": (
        {"loss_type": "grpo", "num_iterations": 2, "epsilon": 0.02, "beta": 0.04},
        ("--grpo.loss_type", "grpo", "--grpo.num_iterations", "2", "--grpo.epsilon", "0.02", "--grpo.beta", "0.04"),
    ),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
        ("--grpo.loss_type", "grpo", "--grpo.importance_sampling_level", "sequence", "--grpo.beta", "0.04"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_equals_trls_grpo_trainer_on_its_rollouts(tmp_path, model_folder, one_rank, case):
    trl_options, flags = CASES[case]
    rows = prompt_rows()
    theirs, rollouts = trl_run(model_folder, tmp_path, rows, **trl_options)
    ours = titan_run(model_folder, tmp_path, one_rank, rows, rollouts, *flags)
    assert len(ours) == len(theirs) == STEPS
    keys = ("loss", "grad_norm", *METRICS, *CLIPS, *(("kl",) if trl_options.get("beta") else ()))
    for step, (mine, ref) in enumerate(zip(ours, theirs, strict=True), 1):
        # A step that reuses its generation batch logs no reward or completion metrics, in both.
        assert {k for k in keys if k in mine} == {k for k in keys if k in ref}, (case, step)
        for key in (k for k in keys if k in ref):
            assert _close(mine[key], ref[key]), (case, step, key, mine[key], ref[key])
    if trl_options.get("num_iterations"):
        assert ours[1]["clip_ratio/region_mean"] > 0  # the reused step's ratios left 1 and clipped
    assert ours[-1]["grad_norm"] > 0  # it trained on a signal
    lengths = {len(r["completion_ids"]) for r in rollouts}
    assert len(lengths) > 3 and max(lengths) == COMPLETION  # ended and truncated completions of many lengths

"""One step off-policy GRPO (`grpo.max_staleness = 1`, issue 59): step 2 trains, on the weights after step 1,
the batch the starting weights generated during step 1, and its loss is TRL's dapo loss with the generating
policy's log-probs as the old ones. The reference is written here: transformers' log-probs of step 2's
completions (from the rollout log) on the starting folder (old) and on the Hugging Face export of a 1-step
run (current), advantages from the logged rewards of each group (mean, Bessel std + 1e-4), and
sum over the completion tokens of -min(rho A, clip(rho, 1 - eps, 1 + eps) A) / their count.

Planted once (2026-12-03): the current policy's log-probs taken as the old ones for the held batch (so the
ratio is 1) fails it: step 2's loss -0.4406 against the reference's -0.2600 (the mean |current - old|
log-prob is 0.93 there: lr 2e-2 on a tiny model moves it far in one step).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_grpo_trl import prompt_rows
from test_preference_trl import chatml_model
from tiny_llama import from_hf_flags
from transformers import LlamaForCausalLM

from titan_train.config import load_job_config
from titan_train.config.validate import validate_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.trainer import Trainer

B, G, COMPLETION, LR, EPSILON = 8, 4, 8, 2e-2, 0.05
WEIGHTS = (1.0, 0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_rank):
    """A 1-step run (its Hugging Face export: the weights step 2 trains) and a 2-step run, one step off-policy."""
    root = tmp_path_factory.mktemp("off_policy")
    folder = chatml_model(root / "model")
    generation = folder / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**config, "eos_token_id": list(range(100, 400))}))
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    dumps = {}
    for steps in (1, 2):
        dump = dumps[steps] = root / f"steps{steps}"
        flags = [
            *from_hf_flags(folder, dump),
            "--training.dataset", "prompts",
            "--training.dataset_path", str(data),
            "--training.seq_len", "96",
            "--training.local_batch_size", str(B),
            "--training.steps", str(steps),
            "--grpo.num_generations", str(G),
            "--grpo.max_prompt_length", "48",
            "--grpo.max_completion_length", str(COMPLETION),
            "--grpo.reward_funcs", "grpo_rewards:vowel_share,grpo_rewards:hint_length",
            "--grpo.reward_weights", ",".join(map(str, WEIGHTS)),
            "--grpo.epsilon", str(EPSILON),
            "--grpo.max_staleness", "1",
            "--optimizer.lr", str(LR),
            "--lr_scheduler.decay_ratio", "0",
            "--checkpoint.last_save_in_hf",
        ]  # fmt: skip
        Trainer(resolve(load_job_config(flags), 1, "cpu"), one_rank).train()
    return folder, dumps


def _logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _advantages(rows: list[dict]) -> list[float]:
    rewards = []
    for row in rows:
        values = [(w, v) for w, v in zip(WEIGHTS, row["rewards"].values(), strict=True) if v is not None]
        rewards.append(sum(w * v for w, v in values))
    out = []
    for g in range(0, len(rewards), G):
        group = rewards[g : g + G]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        out += [(r - mean) / (std + 1e-4) for r in group]
    return out


def test_a_stale_step_uses_the_generating_policys_logprobs(runs):
    folder, dumps = runs
    records = [json.loads(line) for line in (dumps[2] / "metrics.jsonl").read_text().splitlines()]
    first = json.loads((dumps[1] / "metrics.jsonl").read_text())
    assert first["loss"] == records[0]["loss"] and first["grad_norm"] == records[0]["grad_norm"]
    assert [r["off_policy/lag_steps"] for r in records] == [0, 1]
    lines = (dumps[2] / "rollouts" / "rank0.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["step"] == 2]
    assert len(rows) == B
    old_model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    current_model = LlamaForCausalLM.from_pretrained(dumps[1] / "checkpoint" / "step-1", dtype=torch.float32)
    total, tokens, gap = 0.0, 0, 0.0
    for row, a in zip(rows, _advantages(rows), strict=True):
        old = _logps(old_model, row["prompt_ids"], row["completion_ids"])
        current = _logps(current_model.eval(), row["prompt_ids"], row["completion_ids"])
        rho = torch.exp(current - old)
        total += (-torch.minimum(rho * a, rho.clamp(1 - EPSILON, 1 + EPSILON) * a)).sum().item()
        tokens += len(old)
        gap += (current - old).abs().sum().item()
    step2 = records[1]
    print(f"step 2 loss {step2['loss']:.6f} against {total / tokens:.6f}; gap {gap / tokens:.4f}")
    assert step2["loss"] == pytest.approx(total / tokens, rel=1e-4, abs=1e-6)
    assert step2["off_policy/old_logp_gap"] == pytest.approx(gap / tokens, rel=1e-4)
    assert gap / tokens > 0.01 and step2["clip_ratio/region_mean"] > 0  # the ratio left 1 and clipped


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--grpo.max_staleness", "2"), r"grpo.max_staleness must be at most 1, got 2"),
        (("--grpo.max_staleness", "-1"), r"grpo.max_staleness must be at least 0, got -1"),
        (
            ("--grpo.max_staleness", "1", "--grpo.num_iterations", "2"),
            r"grpo.max_staleness = 1 and grpo.num_iterations > 1 .*: set one of them back to its default",
        ),
        (
            ("--grpo.max_staleness", "1", "--grpo.replay_rollouts", "PROMPTS"),
            r"grpo.max_staleness = 1 and grpo.replay_rollouts .*: set grpo.max_staleness = 0",
        ),
    ],
)
def test_what_one_step_off_policy_cannot_do_is_refused_in_one_line(tmp_path, extra, says):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    flags = [
        *(
            "--training.dataset",
            "prompts",
            "--training.dataset_path",
            str(data),
            "--training.seq_len",
            "1024",
        ),
        *("--grpo.reward_funcs", "answer_match", *(str(data) if f == "PROMPTS" else f for f in extra)),
    ]
    with pytest.raises(ConfigError, match=says) as refused:
        validate_config(load_job_config(flags))
    assert "\n" not in str(refused.value)

"""The debug GRPO config as a user runs it (`titan-train --job.config_file apps/configs/debug_grpo.toml`: the
bundled arithmetic prompts, the titan engine sampling 8 answers per prompt, answer_match and number_format):
the mean reward rises clearly within 16 steps (0.01 over steps 1-3, 0.94 at step 14 with each completion seeded
on its own, 2026-12-03; one generator for the whole batch had it past 0.4 by steps 10-12). Then the engine is the
policy: the run, resumed from its step-16 save with greedy sampling (top_k 1) for one more step, generates for
step 17 exactly the tokens transformers' greedy `generate` gives on the step-16 Hugging Face export from the
same prompt ids, stopped
at the same end ids (the tokenizer's EOS and the template's <|eot_id|>). `titan-train report` draws the
reward curve.

One step off-policy (`--grpo.max_staleness 1`, the config otherwise as it is) the mean reward still rises, more
slowly: measured 2026-12-03 with each completion seeded on its own, over STALE_STEPS = 24 steps, from 0.006
(steps 1-3) to 0.47 (steps 22-24; flat near 0.01 until step 12, 0.25 at step 17), where on-policy it passes
0.9 by step 14 (one generator for the batch gave 0.29 by step 14 off-policy); at lr 3e-3 the policy moves up to 2 nats a token per step
(`off_policy/old_logp_gap`), most ratios clip, and its completions settle on one well-formatted wrong answer
(number_format's 0.3). Planted once (2026-12-03): step 1's batch held again for every later step instead of
the one generated ahead fails it (the logged lag grows, 2 at step 3).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from titan_train.wiring.data import BUNDLED_TOKENIZER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "apps" / "configs" / "debug_grpo.toml"
STEPS = 16
STALE_STEPS = 24


def _run(dump: Path, *flags: str) -> None:
    base = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.disable_color_printing"]
    base += ["--metrics.enable_tensorboard"]
    save = ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.last_save_in_hf"]
    cmd = [sys.executable, "-m", "titan_train.cli", "--job.config_file", str(CONFIG), *base, *save, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("debug_grpo")
    _run(dump, "--training.steps", str(STEPS))
    _run(dump, "--training.steps", str(STEPS + 1), "--grpo.top_k", "1")
    return dump


def test_debug_grpo_config_raises_the_mean_reward(grpo_run):
    records = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    rewards = {r["step"]: r["reward"] for r in records}
    assert sorted(rewards) == list(range(1, STEPS + 2))
    first, last = (
        sum(rewards[s] for s in (1, 2, 3)) / 3,
        sum(rewards[s] for s in range(STEPS - 2, STEPS + 1)) / 3,
    )
    assert first < 0.3 and last > first + 0.4, rewards


def test_debug_grpo_config_raises_the_mean_reward_one_step_off_policy(tmp_path):
    _run(tmp_path, "--training.steps", str(STALE_STEPS), "--grpo.max_staleness", "1")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["off_policy/lag_steps"] for r in records] == [0] + [1] * (STALE_STEPS - 1)
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1 and last > first + 0.2, rewards


def test_report_draws_the_reward_curve(grpo_run, tmp_path):
    from titan_train.reporting.report import build_report, draw, find_event_folder, read_scalars

    records = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    figure = draw(read_scalars(find_event_folder(grpo_run)), tmp_path / "fig.png", title="grpo")
    (reward,) = [ax for ax in figure.axes if ax.get_title() == "reward"]
    assert list(reward.lines[0].get_ydata()) == pytest.approx([r["reward"] for r in records])
    assert any(row.startswith("reward") for row in build_report(grpo_run, tmp_path / "r.png").table)


def test_the_engine_generates_what_transformers_generates_on_the_steps_export(grpo_run):
    export = grpo_run / "checkpoint" / f"step-{STEPS}"
    model = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>")]
    lines = (grpo_run / "rollouts" / "rank0.jsonl").read_text().splitlines()
    step = [r for r in map(json.loads, lines) if r["step"] == STEPS + 1]
    assert len(step) == 16
    for row in step:
        ids = torch.tensor([row["prompt_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=8, do_sample=False, eos_token_id=ends, pad_token_id=ends[0]
            )
        assert out[0, ids.shape[1] :].tolist() == row["completion_ids"], row["prompt_index"]

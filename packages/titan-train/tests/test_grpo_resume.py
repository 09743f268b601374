"""GRPO with the titan engine resumes bit for bit (issue 59): a run killed (SIGKILL) mid-step, after its
rollouts were generated and before it trained on them, and a run killed after a step (the kill drill), each
resumed from its step-2 checkpoint, log the same steps 3 and 4 as an uninterrupted run (loss, grad_norm,
rewards, the sampled completions) and end with the same weights. The rollouts are sampled (temperature 1,
top_k 50) from a generator seeded by the run's seed, the step and its prompts, so the resumed step 3
draws the completions the interrupted one drew; the rollout log holds each step once.

With grpo.num_iterations = 2, a run killed after step 4 (which trained again on step 3's rollouts) resumes
from its step-3 save: the rollouts and their old log-probs come back from the checkpoint.

With grpo.max_staleness = 1 (one step off-policy), the step-2 save holds the batch generated during step 2
for step 3, with its old log-probs, and the data's position after step 3's prompts: a run killed after step
3, or during step 3's generation of step 4's batch (the 4th reward call), resumes bit for bit.

Planted once each (2026-12-02): a resumed log that keeps the interrupted run's lines (no
`RolloutLog.resume_from`) fails it (step 3 logged twice); rollouts left out of the checkpoint (no
`grpo_rollouts` state) fail the between-reuses case at the resumed step 4 ("not held"). Planted 2026-12-03: the held batch left out
of the checkpoint (no `grpo_pending` state) fails both stale cases (the resumed step 3 generates its own
batch from the next prompts: other rewards and losses). Sampling from the global generator instead of
the seeded one still passes: the checkpoint restores the global generator too (train_state), so the seed
is what keeps rollouts independent of everything else that draws from it, not what makes resume exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_new_objective import _model

HERE = Path(__file__).parent
KEYS = ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length")


def _prompts(path: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Say {a} then {b}."}]} for a, b in
            ((1, 2), (2, 2), (3, 4), (5, 1), (6, 2), (7, 3), (2, 9), (4, 4))]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def grpo_flags(tmp: Path, dump: str, *extra: str) -> list[str]:
    """A 4-step GRPO run of the debug model on the prompts `_prompts` wrote, checkpointed every 2 steps."""
    return [
        *("--job.dump_folder", str(tmp / dump), "--training.dataset", "prompts"),
        *("--training.dataset_path", str(tmp / "prompts.jsonl"), "--training.seq_len", "64"),
        *("--training.local_batch_size", "4", "--training.steps", "4", "--activation_checkpoint.mode", "none"),
        *("--grpo.num_generations", "2", "--grpo.max_prompt_length", "48", "--grpo.max_completion_length", "8"),
        *("--grpo.top_k", "50", "--grpo.beta", "0.05"),
        *("--grpo.reward_funcs", "grpo_rewards:vowel_share_or_die,grpo_rewards:hint_length"),
        *("--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--metrics.disable_color_printing"),
        *("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"),
        *("--metrics.enable_tensorboard", "false", "--optimizer.lr", "1e-2"),
        *extra,
    ]  # fmt: skip


def reward_module_env(env: dict | None = None) -> dict:
    """The environment of a run whose reward functions live in this folder (grpo_rewards)."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **(env or {})}


def _train(tmp: Path, dump: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *grpo_flags(tmp, dump, *extra)],
        env=reward_module_env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _records(tmp: Path, dump: str) -> list[list]:
    lines = (tmp / dump / "metrics.jsonl").read_text().splitlines()
    return [[json.loads(line).get(k) for k in ("step", *KEYS)] for line in lines]


def _rollouts(tmp: Path, dump: str) -> list[tuple]:
    lines = (tmp / dump / "rollouts" / "rank0.jsonl").read_text().splitlines()
    return [(r["step"], r["prompt_index"], r["completion_ids"]) for r in map(json.loads, lines)]


# Two optimizer steps per generation batch, saved after step 3 (a generation step): the resumed step 4
# trains on step 3's rollouts, which only the checkpoint holds.
REUSED = (
    "--grpo.num_iterations",
    "2",
    "--grpo.epsilon",
    "0.05",
    "--checkpoint.interval",
    "3",
    "--training.steps",
    "5",
)


STALE = ("--grpo.max_staleness", "1")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_resume")
    _prompts(tmp / "prompts.jsonl")
    for dump, extra in (("whole", ()), ("whole_reused", REUSED), ("whole_stale", STALE)):
        run = _train(tmp, dump, *extra)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return tmp


@pytest.mark.parametrize(
    "kill", ["mid_step", "after_step", "between_reuses", "stale_mid_generation", "stale_after_step"]
)
def test_a_killed_grpo_run_resumes_bit_for_bit(whole, kill):
    dump, reference, extra, saved, last = f"resumed_{kill}", "whole", (), "step-2", 4
    if kill.startswith("stale"):
        reference, extra = "whole_stale", STALE
    if kill == "mid_step":  # step 3's reward call: after generation, before training
        killed = _train(whole, dump, env={"TITAN_TEST_DIE_AT": "3"})
    elif kill == "stale_mid_generation":  # reward calls: 2 at step 1 (its batch and step 2's), then 1 a step
        killed = _train(whole, dump, *extra, env={"TITAN_TEST_DIE_AT": "4"})
    elif kill in ("after_step", "stale_after_step"):
        killed = _train(whole, dump, *extra, "--health.drill", "kill", "--health.drill_step", "3")
    else:  # after step 4, which reused step 3's rollouts (unsaved: the saves are at 3 and 5)
        reference, extra, saved, last = "whole_reused", REUSED, "step-3", 5
        killed = _train(whole, dump, *extra, "--health.drill", "kill", "--health.drill_step", "4")
    assert killed.returncode != 0 and (whole / dump / "checkpoint" / saved).is_dir()
    assert not (whole / dump / "checkpoint" / "step-4").exists()
    resumed = _train(whole, dump, *extra)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    expected, got = _records(whole, reference), _records(whole, dump)
    assert [r[0] for r in expected] == list(range(1, last + 1))
    assert expected[0][1:] != expected[-1][1:]  # it trained
    assert got == expected
    assert _rollouts(whole, dump) == _rollouts(
        whole, reference
    )  # each step logged once, the same completions
    folder = f"checkpoint/step-{last}"
    a, b = _model(whole / reference / folder), _model(whole / dump / folder)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

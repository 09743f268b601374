"""Reward functions with TRL's GRPOTrainer signature (`titan_train.objectives.rewards`): the built-ins against
TRL's own `think_format_reward` and against GSM8K- and MATH-style rows written here, a user's `module:function`
loaded from a file on disk, and the (B, F) table with None as NaN that `grpo_loss.group_advantages` takes.
Planted once (2026-12-02): `think_format` without its "no second <think>" lookahead fails the TRL comparison."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from titan_train.errors import ConfigError
from titan_train.objectives.grpo_loss import group_advantages
from titan_train.objectives.rewards import (
    BadReward,
    answer_match,
    load_reward_function,
    number_format,
    score,
    think_format,
)

trl = pytest.importorskip("trl")


def test_think_format_equals_trls_think_format_reward():
    from trl.rewards import think_format_reward

    texts = [
        "<think>\nreasoning\n</think>\nanswer",
        "<think>reasoning</think>",
        "<think>\nreasoning only",
        "answer first <think>late</think>",
        "<think>a</think><think>b</think>",
        "<think>\nmulti\nline\n</think>\n\n#### 4",
        "",
    ]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    expected = think_format_reward(conversational)
    assert think_format(conversational) == expected
    assert think_format(texts) == expected  # standard (string) completions read the same
    assert expected == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_answer_match_reads_gsm8k_and_boxed_answers_and_abstains_without_a_reference():
    completions = [
        "She pays 3 * 4 = 12 dollars.\n#### 12",  # GSM8K's own format
        "The total is $1,234.",  # last number, with a comma and a dollar sign
        "So the answer is \\boxed{\\frac{1}{2}}.",  # MATH's boxed answer, braces nested
        "I think it is 7, no wait, 8",  # the last number counts
        "no number at all",
        [{"role": "assistant", "content": "#### 5"}],  # a conversational completion
        "anything",
    ]
    answer = ["Natalia... #### 12", "#### 1234", None, "#### 7", "#### 3", "#### 5", None]
    solution = [None, None, "We get $\\boxed{\\frac{1}{2}}$", None, None, None, "no boxed answer here"]
    assert answer_match(completions, answer=answer, solution=solution) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, None]


def test_a_users_reward_function_is_loaded_by_module_and_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, completion_ids, **kw):\n    return [1.0 / (1 + len(ids)) for ids in completion_ids]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("my_rewards:short")
    assert fn(completions=["a", "b"], completion_ids=[[1], [1, 2, 3]]) == [0.5, 0.25]
    assert load_reward_function("answer_match") is answer_match
    for spec, message in (
        ("nope", "neither a built-in"),
        ("no_such_module_here:f", "cannot import 'no_such_module_here'"),
        ("my_rewards:missing", "has no function 'missing'"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_reward_function(spec)
    sys.modules.pop("my_rewards", None)


def test_scores_keep_abstentions_as_nan_and_an_unscorable_completion_gets_no_advantage():
    completions = ["#### 1", "#### 2", "<think>x</think> #### 1", "#### 9"]
    columns = {"answer": ["#### 1", "#### 1", "#### 1", None]}
    functions = [("answer_match", answer_match), ("think_format", think_format)]
    table = score(
        functions, prompts=["q"] * 4, completions=completions, completion_ids=[[1]] * 4, columns=columns
    )
    assert table[:, 0].tolist()[:3] == [1.0, 0.0, 1.0] and math.isnan(table[3, 0])
    assert table[:, 1].tolist() == [0.0, 0.0, 1.0, 0.0]
    advantages, rewards = group_advantages(table, torch.tensor([1.0, 0.5]), num_generations=4)
    assert rewards.tolist()[:3] == [1.0, 0.0, 1.5]  # the abstaining function's NaN is skipped, not zero
    with pytest.raises(ValueError, match="returned 1 values for 4 completions"):
        score(
            [("bad", lambda **kw: [1.0])], prompts=[], completions=completions, completion_ids=[], columns={}
        )
    nan = [("nan", lambda **kw: [1.0, None, float("nan"), 0.0])]
    with pytest.raises(BadReward, match="returned NaN .use None") as raised:
        score(nan, prompts=[], completions=completions, completion_ids=[], columns={})
    assert raised.value.index == 2  # the completion whose row the run names


def test_number_format_is_the_share_of_digits_among_visible_characters():
    texts = ["42", " 4 2 ", "x42y", "", "answer: 7", [{"role": "assistant", "content": "12."}]]
    assert number_format(texts) == [1.0, 1.0, 0.5, 0.0, 1 / 8, 2 / 3]
    assert load_reward_function("number_format") is number_format


def test_a_reward_function_that_fails_mid_run_stops_it_in_one_line_naming_the_step(
    tmp_path, monkeypatch, caplog
):
    """A user's function raising at step 2 stops `titan-train` with exit status 2 and one error line naming
    the step, the rows and the function's own error (not a traceback from the trainer). Planted once: the
    run's one-line errors without `RewardFailed` let the traceback escape and the test failed."""
    import logging

    from titan_train.cli import run

    (tmp_path / "flaky_rewards.py").write_text(
        "calls = []\n"
        "def flaky(completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        raise ValueError('planted at the second call')\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--job.config_file", "apps/configs/debug_grpo.toml", "--job.dump_folder", str(tmp_path / "run")]
    argv += [
        "--training.steps",
        "3",
        "--grpo.reward_funcs",
        "flaky_rewards:flaky",
        "--grpo.reward_weights",
        "1.0",
    ]
    argv += [
        "--training.local_batch_size",
        "4",
        "--grpo.num_generations",
        "2",
        "--grpo.max_completion_length",
        "4",
    ]
    with caplog.at_level(logging.ERROR):
        assert run(argv) == 2
    sys.modules.pop("flaky_rewards", None)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("grpo: a reward function failed at step 2 on the prompts of "), line
    assert line.endswith("ValueError: planted at the second call") and "\n" not in line, line

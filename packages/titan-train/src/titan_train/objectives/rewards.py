"""Reward functions for learning from rewards (issue 59), with TRL's `GRPOTrainer` signature, and two built-ins.

A reward function is called once per batch of completions as `fn(prompts=..., completions=...,
completion_ids=..., **columns)`: lists of equal length, `completions` the texts (or, for conversational
prompts, each a list with one assistant message), `completion_ids` their token ids, and every other column of
the prompt rows as a keyword list. It returns one float per completion, or None where it does not apply. A
function is named as `module:function` (imported) or by a built-in name:

- `answer_match`: 1.0 when the completion's final answer equals the row's reference answer, else 0.0; None where
  the row has no reference answer that can be read. The reference comes from the `answer` column (GSM8K's
  "... #### 42") or the `solution` column (the content of its last `\\boxed{...}`); the completion's answer is
  its last `\\boxed{...}`, else what follows its last `####`, else its last number. Numbers compare as numbers
  (commas, a leading `$` and a trailing `.` dropped); other answers compare as stripped text.
- `number_format`: the share of the completion's non-space characters that are digits (1.0: a bare number, as
  "answer with the number only" asks); 0.0 for an empty completion. A shaping reward beside `answer_match`.
- `think_format`: 1.0 when the completion starts with one `<think>...</think>` block (no second `<think>`), as
  TRL's `think_format_reward` checks, else 0.0.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from titan_train.errors import ConfigError

RewardFunction = Callable[..., list[float | None]]

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _normalised(answer: str) -> str | float:
    answer = answer.strip().rstrip(".").strip()
    number = answer.replace(",", "").removeprefix("$")
    try:
        return float(number)
    except ValueError:
        return answer


def reference_answer(row_answer: str | None, row_solution: str | None) -> str | float | None:
    if row_answer is not None and "####" in row_answer:
        return _normalised(row_answer.rsplit("####", 1)[1])
    if row_answer is not None and row_answer.strip():
        return _normalised(row_answer)
    boxed = _last_boxed(row_solution) if row_solution is not None else None
    return _normalised(boxed) if boxed is not None else None


def final_answer(text: str) -> str | float | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return _normalised(boxed)
    if "####" in text:
        return _normalised(text.rsplit("####", 1)[1].strip().split("\n")[0])
    numbers = _NUMBER.findall(text)
    return _normalised(numbers[-1]) if numbers else None


def answer_match(completions, answer=None, solution=None, **_) -> list[float | None]:
    rewards: list[float | None] = []
    for i, completion in enumerate(completions):
        gold = reference_answer(answer[i] if answer else None, solution[i] if solution else None)
        if gold is None:
            rewards.append(None)
            continue
        got = final_answer(_text(completion))
        if isinstance(gold, float) and isinstance(got, float):
            rewards.append(1.0 if math.isclose(got, gold, rel_tol=1e-9, abs_tol=1e-9) else 0.0)
        else:
            rewards.append(1.0 if got == gold else 0.0)
    return rewards


def number_format(completions, **_) -> list[float | None]:
    out: list[float | None] = []
    for c in completions:
        chars = [ch for ch in _text(c) if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


def think_format(completions, **_) -> list[float | None]:
    return [1.0 if _THINK.match(_text(c)) else 0.0 for c in completions]


BUILT_IN: dict[str, RewardFunction] = {
    "answer_match": answer_match,
    "number_format": number_format,
    "think_format": think_format,
}


def load_reward_function(spec: str) -> RewardFunction:
    """A built-in reward by name, or `module:function` imported; ConfigError naming the fix otherwise."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(
            f"config: reward function {spec!r} is neither a built-in ({', '.join(BUILT_IN)}) nor 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"config: reward function {spec!r}: cannot import {module_name!r} ({err})") from err
    fn = vars(module).get(name)
    if not callable(fn):
        raise ConfigError(f"config: reward function {spec!r}: {module_name} has no function {name!r}")
    return fn


class RewardFailed(RuntimeError):
    """A reward function failed mid-run (raised, or gave an unusable answer): not a config to fix but the
    user's function, named with the step and the row; `titan-train` prints it in one line and stops."""


class BadReward(ValueError):
    """A reward function's answer that cannot be used: the wrong count, or NaN at completion `index`."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


def score(
    functions: Sequence[tuple[str, RewardFunction]],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> torch.Tensor:
    """(B, F) float64 rewards, NaN where a function returned None (see `grpo_loss.group_advantages`); BadReward
    for a wrong count or a NaN (None says "not applicable"; NaN is a function's bug, named with its row)."""
    out = torch.empty(len(completions), len(functions), dtype=torch.float64)
    for j, (spec, fn) in enumerate(functions):
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if len(values) != len(completions):
            raise BadReward(
                f"reward function {spec} returned {len(values)} values for {len(completions)} completions"
            )
        floats = [math.nan if v is None else float(v) for v in values]
        nan = next(
            (k for k, (v, f) in enumerate(zip(values, floats, strict=True)) if v is not None and f != f), None
        )
        if nan is not None:
            raise BadReward(f"reward function {spec} returned NaN (use None for 'not applicable')", nan)
        out[:, j] = torch.tensor(floats, dtype=torch.float64)
    return out

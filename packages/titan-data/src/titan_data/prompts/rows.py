"""Prompt rows in TRL's prompt-only layout, tokenised as the policy will continue them.

A row's `prompt` is a conversation (a list of turns, rendered by the model's chat template with its
generation prompt, and the row's `tools` if any) or plain text (tokenised as the tokenizer frames a
document: BOS where it adds one, no template), as TRL's `GRPOTrainer` treats the two. Every other column
is kept for the reward functions. A prompt longer than `max_length` tokens keeps its last `max_length`
(overlong "truncate", so the generation prompt survives) or is dropped ("drop"); both are counted and said.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_data.chat.rows import TOOLS_FIELD, _check_message, _row_tools, raw_rows
from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)

PROMPT_FIELD = "prompt"
OVERLONG = ("truncate", "drop")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, the prompt as the row gave it, the row's other columns, where it came from."""

    ids: np.ndarray
    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def _prompt_value(row: Any, where: str) -> str | list[dict[str, Any]]:
    if not isinstance(row, dict):
        raise DataError(f"dataset: {where} is a {type(row).__name__}, not an object with fields")
    prompt = row.get(PROMPT_FIELD)
    if prompt is None:
        raise DataError(f"dataset: {where}: no '{PROMPT_FIELD}' field (fields: {', '.join(map(str, row))})")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"dataset: {where}: '{PROMPT_FIELD}' is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"dataset: {where}: '{PROMPT_FIELD}' must be text or a non-empty list of turns")
    return [_check_message(turn, where, PROMPT_FIELD) for turn in prompt]


def prompt_ids(
    prompt: str | list[dict[str, Any]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    tools: list | None = None,
) -> list[int]:
    """The ids generation continues: the rendered conversation with its generation prompt, or the text."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, bos=True)
    return tokenizer.encode_chat(template.render(prompt, add_generation_prompt=True, tools=tools))


def load_prompts(
    path: str | Path,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    max_length: int,
    *,
    overlong: str = "truncate",
    bad_rows: str = "stop",
) -> list[Prompt]:
    """Every prompt at `path` (local .jsonl/.json/.parquet files or a hub dataset id), in order."""
    if overlong not in OVERLONG:
        raise DataError(f"dataset: overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    prompts: list[Prompt] = []
    truncated = dropped = skipped = 0
    for row, where in raw_rows(path):
        try:
            if isinstance(row, DataError):
                raise row
            prompt = _prompt_value(row, where)
            tools = _row_tools(row, where) if not isinstance(prompt, str) else None
            ids = prompt_ids(prompt, template, tokenizer, tools)
        except DataError as err:
            if bad_rows == "stop":
                raise
            skipped += 1
            logger.warning("%s (skipped: sft.bad_rows = 'skip')", err)
            continue
        if len(ids) > max_length:
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            ids = ids[-max_length:]
        columns = {k: v for k, v in row.items() if k not in (PROMPT_FIELD, TOOLS_FIELD)}
        prompts.append(Prompt(np.asarray(ids, dtype=np.int64), prompt, columns, where))
    if truncated or dropped:
        logger.warning(
            "dataset: %s: %d prompts longer than max_prompt_length (%d tokens) %s",
            path,
            truncated or dropped,
            max_length,
            "kept their last tokens" if truncated else "dropped (overlong = 'drop')",
        )
    if not prompts:
        raise DataError(
            f"dataset: {path} holds no usable prompt ({dropped} too long, {skipped} bad); check the rows' "
            f"'{PROMPT_FIELD}' field or raise max_prompt_length"
        )
    return prompts

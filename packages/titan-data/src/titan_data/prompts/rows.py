"""Prompt rows in TRL's prompt-only layout, tokenised as the policy will continue them.

A row's `prompt` (or the column `PromptFields.prompt` names: GSM8K's `question`) is a conversation (a
list of turns, rendered by the model's chat template with its generation prompt, and the row's `tools` if
any) or plain text (tokenised as the tokenizer frames a document: BOS where it adds one, no template), as
TRL's `GRPOTrainer` treats the two; plain text can instead be framed as a user turn, and a system turn put
first, so that a chat model sees a text dataset the way it was tuned. Every other column is kept for the
reward functions. A prompt longer than `max_length` tokens keeps its last `max_length`
(overlong "truncate", so the generation prompt survives) or is dropped ("drop"); both are counted and said.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from titan_data.chat.rows import TOOLS_FIELD, _check_message, _row_tools, rows_at
from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)

PROMPT_FIELD = "prompt"
OVERLONG = ("truncate", "drop")


@dataclass(frozen=True)
class PromptFields:
    """Where a row holds its prompt, and how plain text is framed: as it is (TRL's way), or as a user turn
    (`text_as_turn`); `system`, where given, is put first as a system turn in a conversation without one."""

    prompt: str = PROMPT_FIELD
    text_as_turn: bool = False
    system: str = ""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, the prompt as the policy is shown it (the row's, framed by its
    `PromptFields`), the row's other columns, where it came from."""

    ids: np.ndarray
    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def _prompt_value(row: Any, where: str, name: str) -> str | list[dict[str, Any]]:
    if not isinstance(row, dict):
        raise DataError(f"dataset: {where} is a {type(row).__name__}, not an object with fields")
    prompt = row.get(name)
    if prompt is None:
        raise DataError(f"dataset: {where}: no '{name}' field (fields: {', '.join(map(str, row))})")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"dataset: {where}: '{name}' is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"dataset: {where}: '{name}' must be text or a non-empty list of turns")
    return [_check_message(turn, where, name) for turn in prompt]


def framed(
    prompt: str | list[dict[str, Any]], fields: PromptFields, where: str
) -> str | list[dict[str, Any]]:
    """The prompt as the policy is shown it: plain text as a user turn where asked, the system turn first."""
    if isinstance(prompt, str) and fields.text_as_turn:
        prompt = [{"role": "user", "content": prompt}]
    if not fields.system:
        return prompt
    if isinstance(prompt, str):
        raise DataError(
            f"dataset: {where}: '{fields.prompt}' is plain text, which has no turns to put a system prompt "
            "before; frame it as a user turn (grpo.text_prompts = 'user_turn') or leave the system prompt empty"
        )
    if prompt[0]["role"] == "system":
        return prompt
    return [{"role": "system", "content": fields.system}, *prompt]


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
    fields: PromptFields | None = None,
    split: str = "",
    config: str = "",
    overlong: str = "truncate",
    bad_rows: str = "stop",
) -> list[Prompt]:
    """Every prompt at `path` (local .jsonl/.json/.parquet files, a saved dataset, or a hub dataset id with
    its `split` and `config`), in order."""
    if overlong not in OVERLONG:
        raise DataError(f"dataset: overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    fields = fields or PromptFields()
    prompts: list[Prompt] = []
    truncated = dropped = skipped = 0
    for row, where in rows_at(path, split, config):
        try:
            if isinstance(row, DataError):
                raise row
            prompt = framed(_prompt_value(row, where, fields.prompt), fields, where)
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
        columns = {k: v for k, v in row.items() if k not in (fields.prompt, TOOLS_FIELD)}
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
            f"'{fields.prompt}' field or raise max_prompt_length"
        )
    return prompts

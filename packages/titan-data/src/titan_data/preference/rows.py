"""Preference rows in TRL's three layouts, as (prompt, chosen, rejected) lists of turns.

Conversational: `prompt` a list of turns, `chosen` and `rejected` lists of (assistant) turns. Plain
text: three strings, which become a user turn and two assistant turns, as chat rows' prompt/completion
pairs do, so every layout is rendered by the model's chat template. Implicit prompt: `chosen` and
`rejected` are whole conversations, and the prompt is the turns they share from the start (as TRL's
`extract_prompt` finds it). A bad row becomes a DataError naming the file, the row and the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_data.chat.rows import _check_message, rows_at
from titan_data.errors import DataError

COMPLETIONS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferenceRow:
    """One pair: the shared prompt's turns, each completion's turns, and where the row came from."""

    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]
    where: str


def _turns(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"dataset: {where}: '{field}' must be a non-empty list of turns")
    return [_check_message(turn, where, field) for turn in value]


def _completion(turns: list[dict[str, str]], where: str, field: str) -> list[dict[str, str]]:
    """A completion must hold an assistant turn with something in it: its tokens are what is compared."""
    answers = [t for t in turns if t["role"] == "assistant"]
    if not answers:
        raise DataError(f"dataset: {where}: '{field}' has no assistant turn to score")
    if not any(t["content"].strip() or t.get("thinking", "").strip() for t in answers):
        raise DataError(f"dataset: {where}: '{field}' is an empty completion")
    return turns


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def row_to_pair(row: Any, where: str) -> PreferenceRow:
    """The pair one row holds, in any of the three layouts; DataError naming `where` and the field."""
    if not isinstance(row, dict):
        raise DataError(f"dataset: {where} is a {type(row).__name__}, not an object with fields")
    for field in COMPLETIONS:
        if row.get(field) is None:
            raise DataError(f"dataset: {where}: no '{field}' field (fields: {', '.join(map(str, row))})")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) or isinstance(rejected, str):
        for field in ("prompt", *COMPLETIONS):
            if not isinstance(row.get(field), str):
                raise DataError(
                    f"dataset: {where}: '{field}' must be a string like the other fields of a plain-text pair"
                )
        for field in COMPLETIONS:
            if not row[field].strip():
                raise DataError(f"dataset: {where}: '{field}' is an empty completion")
        prompt_turns = [{"role": "user", "content": prompt}]
        chosen_turns = [{"role": "assistant", "content": chosen}]
        rejected_turns = [{"role": "assistant", "content": rejected}]
    else:
        chosen_turns, rejected_turns = _turns(chosen, where, "chosen"), _turns(rejected, where, "rejected")
        if prompt is None:  # implicit prompt: the turns both conversations open with
            shared = _shared_prefix(chosen_turns, rejected_turns)
            prompt_turns = chosen_turns[:shared]
            chosen_turns, rejected_turns = chosen_turns[shared:], rejected_turns[shared:]
            if not prompt_turns:
                raise DataError(
                    f"dataset: {where}: no 'prompt' field, and 'chosen' and 'rejected' share no opening turn "
                    "to take as the prompt"
                )
            if not chosen_turns and not rejected_turns:
                raise DataError(f"dataset: {where}: 'rejected' is the same as 'chosen'")
            for field, turns in (("chosen", chosen_turns), ("rejected", rejected_turns)):
                if not turns:
                    raise DataError(f"dataset: {where}: '{field}' is an empty completion")
        elif isinstance(prompt, str):
            prompt_turns = [{"role": "user", "content": prompt}]
        else:
            prompt_turns = _turns(prompt, where, "prompt")
    _completion(chosen_turns, where, "chosen")
    _completion(rejected_turns, where, "rejected")
    if chosen_turns == rejected_turns:
        raise DataError(f"dataset: {where}: 'rejected' is the same as 'chosen'")
    return PreferenceRow(prompt_turns, chosen_turns, rejected_turns, where)


def read_preference_rows(path: str | Path, config: str = "") -> Iterator[PreferenceRow | DataError]:
    """Every pair at `path` (the sources chat data reads: local files or a hub dataset id), in order; a
    bad row comes as the DataError that names it, so the caller decides whether it stops the run."""
    for row, where in rows_at(path, config=config):
        if isinstance(row, DataError):
            yield row
            continue
        try:
            yield row_to_pair(row, where)
        except DataError as err:
            yield err

"""Preference rows as tokenised pairs: each completion rendered after its prompt by the chat template,
and only the completion's tokens trained, found as supervised fine-tuning finds assistant turns.

A sequence is the prompt followed by one completion, rendered whole; its trained tokens are those of
the assistant turns after the prompt (titan_data.chat.masks, with the prompt's own rendering, generation
prompt included, left out). Chosen and rejected become two (inputs, labels) examples of one `Pair`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_data.chat.dataset import IGNORE, Example
from titan_data.chat.masks import tokenize_conversation
from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.preference.rows import PreferenceRow, read_preference_rows
from titan_data.tokenizers.base import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pair:
    """A prompt's chosen and rejected completions, each as the example of its whole sequence."""

    chosen: Example
    rejected: Example

    @property
    def length(self) -> int:
        """Positions the pair takes when packed: both sequences' inputs."""
        return len(self.chosen.inputs) + len(self.rejected.inputs)


def _sequence(
    row: PreferenceRow,
    completion: list[dict[str, str]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    field: str,
) -> tuple[np.ndarray, np.ndarray]:
    where = f"{row.where} ('{field}')"
    conv = tokenize_conversation(row.prompt + completion, template, tokenizer, "assistant", where)
    prompt_len = len(tokenizer.encode_chat(template.render(row.prompt, add_generation_prompt=True)))
    trained = conv.trained.copy()
    trained[:prompt_len] = False  # an assistant turn of the prompt is context, not the completion
    if not trained.any():
        raise DataError(f"dataset: {row.where}: '{field}' renders to no completion token")
    return conv.tokens, trained


def tokenize_pair(row: PreferenceRow, template: ChatTemplate, tokenizer: Tokenizer) -> tuple:
    """(tokens, trained) of the chosen and of the rejected sequence."""
    return tuple(
        _sequence(row, getattr(row, field), template, tokenizer, field) for field in ("chosen", "rejected")
    )


def _example(tokens: np.ndarray, trained: np.ndarray) -> Example:
    return Example(tokens[:-1], np.where(trained[1:], tokens[1:], IGNORE))


def load_pairs(
    path: str | Path,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    packing: bool,
    overlong: str = "drop",
    bad_rows: str = "stop",
    config: str = "",
) -> list[Pair]:
    """Every pair at `path` (of hub configuration `config`, where it has them), tokenised and masked;
    counts logged. A pair is one unit: it must fit its place, one row for both sequences when packed, a
    row for each when padded. `overlong = "truncate"` cuts each sequence to seq_len inputs (padded); a
    pair that still does not fit is dropped and counted."""
    pairs: list[Pair] = []
    truncated = dropped = skipped = 0
    for row in read_preference_rows(path, config):
        try:
            if isinstance(row, DataError):
                raise row
            sequences = tokenize_pair(row, template, tokenizer)
        except DataError as err:
            if bad_rows == "stop":
                raise
            skipped += 1
            logger.warning("%s (skipped: sft.bad_rows = 'skip')", err)
            continue
        if overlong == "truncate" and any(len(tokens) - 1 > seq_len for tokens, _ in sequences):
            truncated += 1
            sequences = tuple((t[: seq_len + 1], m[: seq_len + 1]) for t, m in sequences)
        pair = Pair(*(_example(tokens, trained) for tokens, trained in sequences))
        fits = (
            pair.length <= seq_len
            if packing
            else max(len(e.inputs) for e in (pair.chosen, pair.rejected)) <= seq_len
        )
        if not fits or (pair.chosen.labels == IGNORE).all() or (pair.rejected.labels == IGNORE).all():
            dropped += 1
            continue
        pairs.append(pair)
    if not pairs:
        raise DataError(
            f"dataset: {path} holds no usable preference pair ({dropped} dropped as longer than seq_len"
            f"{', both sequences in one row when packed' if packing else ''})"
        )
    logger.info(
        "preference data %s: %d pairs; over seq_len %d: %d truncated, %d dropped; %d bad rows skipped",
        path,
        len(pairs),
        seq_len,
        truncated,
        dropped,
        skipped,
    )
    return pairs

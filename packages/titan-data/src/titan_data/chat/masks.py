"""Which tokens of a rendered conversation are trained: its assistant turns, found by prefix rendering.

Turn k's trained span starts where the conversation up to turn k, rendered with the generation prompt
(the assistant header), ends, and stops where the conversation up to and including turn k ends, cut
after its last control token (the end-of-turn marker), so what a template writes after the marker
(a newline) stays masked. That only holds when each rendered prefix tokenises to a token prefix of
the whole; a template that breaks it is refused in one line rather than masked wrongly. One break is
understood: a template that ends a conversation's last turn with another control token than the same
turn followed by more (harmony, gpt-oss's format: <|return|> against <|end|>); an earlier turn is then
trained up to the marker the whole conversation has there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

LOSS_ON = ("assistant", "last", "all")


@dataclass(frozen=True)
class Conversation:
    """A tokenised conversation: `tokens` and, per token, whether it is a training target."""

    tokens: np.ndarray  # int64
    trained: np.ndarray  # bool, same length


def _prefix_length(
    tokenizer: Tokenizer, text: str, whole: list[int], template: ChatTemplate, where: str
) -> int:
    ids = tokenizer.encode_chat(text)
    # A template may close a conversation's last turn with another control token than the same turn
    # followed by more (harmony: <|return|> at the end, <|end|> before the next message); the turn
    # then ends where the whole has its own marker.
    specials = tokenizer.special_ids
    closed_otherwise = (
        len(ids) <= len(whole) and ids[-1:] and ids[-1] in specials and whole[len(ids) - 1] in specials
    )
    if whole[: len(ids)] != ids and not (closed_otherwise and whole[: len(ids) - 1] == ids[:-1]):
        raise DataError(
            f"chat template {template.origin}: at {where} a rendered prefix of the conversation is not a token "
            "prefix of the whole, so turn boundaries cannot be found; use sft.loss_on = 'all' or another template"
        )
    return len(ids)


def tokenize_conversation(
    messages: list[dict[str, str]], template: ChatTemplate, tokenizer: Tokenizer, loss_on: str, where: str
) -> Conversation:
    """Tokens of `messages` as `template` renders them, and the targets `loss_on` trains on."""
    if loss_on not in LOSS_ON:
        raise DataError(f"sft: loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    whole = tokenizer.encode_chat(template.render(messages))
    trained = np.zeros(len(whole), dtype=bool)
    if loss_on == "all":
        trained[:] = True
        return Conversation(np.asarray(whole, dtype=np.int64), trained)
    assistant_turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_turns:
        raise DataError(f"dataset: {where}: the conversation has no assistant turn to train on")
    if loss_on == "last":
        assistant_turns = assistant_turns[-1:]
    specials = tokenizer.special_ids
    for k in assistant_turns:
        start = _prefix_length(
            tokenizer, template.render(messages[:k], add_generation_prompt=True), whole, template, where
        )
        end = _prefix_length(tokenizer, template.render(messages[: k + 1]), whole, template, where)
        markers = [i for i in range(start, end) if whole[i] in specials]
        if markers:
            end = markers[-1] + 1
        trained[start:end] = True
    return Conversation(np.asarray(whole, dtype=np.int64), trained)

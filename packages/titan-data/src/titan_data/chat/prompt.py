"""A conversation made ready for the model to answer: the template's generation prompt, and where to stop.

Generation renders the messages as training did (same template, same special tokens) with the
assistant header appended, and stops at the control token that closes an assistant turn in that
template (`<|eot_id|>` for Llama 3, `<|im_end|>` for Qwen), found as the last control token of the
trained block of a probe conversation (the masks' rule), rather than assumed from the tokenizer's EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_data.chat.masks import trained_spans
from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@dataclass(frozen=True)
class ChatPrompt:
    """Token ids that end with the assistant header, and the id that ends the assistant's turn."""

    ids: list[int]
    end_of_turn_id: int


def end_of_turn_id(template: ChatTemplate, tokenizer: Tokenizer, tools: list | None = None) -> int:
    """The last control token `template` writes in an assistant turn: what a trained answer ends with."""
    text, spans = trained_spans(_PROBE, template, tokenizer, tools)
    ids, offsets = tokenizer.encode_chat_with_offsets(text)
    start, end = spans[-1] if spans else (0, 0)
    markers = [
        i for i, (s, _) in zip(ids, offsets, strict=True) if start <= s < end and i in tokenizer.special_ids
    ]
    if not markers:
        raise DataError(
            f"chat template {template.origin}: an assistant turn ends with no control token, so generation "
            "cannot tell where the answer stops; pass --stop TEXT instead"
        )
    return markers[-1]


def chat_prompt(
    messages: list[dict[str, Any]], template: ChatTemplate, tokenizer: Tokenizer, tools: list | None = None
) -> ChatPrompt:
    """`messages` rendered by `template` with the generation prompt, tokenised as training tokenises them."""
    text = template.render(messages, add_generation_prompt=True, tools=tools)
    return ChatPrompt(tokenizer.encode_chat(text), end_of_turn_id(template, tokenizer, tools))

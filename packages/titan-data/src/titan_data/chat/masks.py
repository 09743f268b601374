"""Which tokens of a rendered conversation are trained: the assistant blocks as the whole render shows them.

The conversation is rendered once, whole, and tokenised once; trained spans are found in that text and
mapped to tokens by their character offsets (a token is trained when it holds a character of a span, as
transformers' `return_assistant_tokens_mask` decides). Nothing is rendered piecewise, so a template may
render a turn differently depending on what follows it (Qwen3 drops the reasoning of answers before the
last question; harmony ends the last answer with <|return|>, earlier ones with <|end|>).

Where the template marks them with `{% generation %}` blocks, those are the spans. Otherwise the spans
are the assistant blocks: the template's generation prompt (what it appends for the model to answer)
names the assistant header, and its first control token starts every message (<|im_start|>,
<|start_header_id|>, <|start|>), or, in templates that start each role with a token of its own (Kimi K2's
<|im_user|>, <|im_assistant|>, <|im_system|>), the first control token of a user or tool message
appended after an answer starts those. A message whose text starts with that header is the assistant's;
consecutive ones (harmony's reasoning, tool call and answer) form one block. A block is trained from the
end of its header (as much of the generation prompt as the text repeats there, so Qwen3's empty think
block under `enable_thinking = false` is prompt, not target) to its last control token (the end-of-turn
marker; the newline a template writes after it stays masked). Tool replies and every other role are not
trained; an assistant's tool calls are, being its own text.

A template whose messages start with no control token (plain `role: text` layouts) falls back to
rendering prefixes: turn k is trained from the end of the conversation up to k with the generation
prompt to the end of the conversation up to and including k, where each such render is a prefix of the
whole text; one that is not is refused in one line rather than masked wrongly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from titan_data.chat.template import ChatTemplate
from titan_data.errors import DataError
from titan_data.tokenizers.base import Tokenizer

LOSS_ON = ("assistant", "last", "all")
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


@dataclass(frozen=True)
class Conversation:
    """A tokenised conversation: `tokens` and, per token, whether it is a training target."""

    tokens: np.ndarray  # int64
    trained: np.ndarray  # bool, same length


@dataclass(frozen=True)
class _Header:
    """How a template starts messages: the text every message starts with (a control token), the
    assistant's header, and the generation prompt (the header and what a prompt adds after it)."""

    message_start: str
    assistant: str
    prompt: str
    other_starts: tuple[str, ...] = ()  # what starts a user or tool message where that differs


@lru_cache(maxsize=64)
def _control_texts(tokenizer: Tokenizer) -> re.Pattern:
    """A pattern matching the text of any control token, longest first."""
    texts = sorted({tokenizer.decode([i]) for i in tokenizer.special_ids} - {""}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts)) or r"(?!)")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@lru_cache(maxsize=64)
def _header(template: ChatTemplate, tokenizer: Tokenizer, tools_json: str) -> _Header | None:
    """The assistant header of `template`, from probe renders made with the row's tools; None when its
    messages do not start with a control token."""
    tools = json.loads(tools_json)
    user, answer = list(_PROBE[:1]), list(_PROBE)
    base = template.render(user, tools=tools)
    prompt = template.render(user, add_generation_prompt=True, tools=tools)
    # An answer followed by more: the header as any assistant turn has it, not only the last one.
    longer = template.render([*answer, {"role": "user", "content": "Bye"}, _PROBE[1]], tools=tools)
    if not (prompt.startswith(base) and longer.startswith(base)):
        return None
    prompt = prompt[len(base) :]
    assistant = prompt[: _common_prefix(prompt, longer[len(base) :])]
    start = _control_texts(tokenizer).match(assistant)
    if start is None or start.end() == len(assistant):
        return None
    others = _other_starts(template, tokenizer, tools, start.group())
    return _Header(start.group(), assistant, prompt, others)


def _other_starts(
    template: ChatTemplate, tokenizer: Tokenizer, tools: list | None, assistant: str
) -> tuple[str, ...]:
    """The first control token of a user and of a tool message appended after an answer, where it is not
    the assistant's own start (templates with a start token per role); none where a render is refused or
    does not extend the answer's."""
    answer = template.render(list(_PROBE), tools=tools)
    starts = []
    for message in (
        {"role": "user", "content": "Bye"},
        {"role": "tool", "content": "42", "tool_call_id": "0"},
    ):
        try:
            longer = template.render([*_PROBE, message], tools=tools)
        except DataError:
            continue
        first = _control_texts(tokenizer).search(longer, len(answer)) if longer.startswith(answer) else None
        if first is not None and first.group() not in (assistant, *starts):
            starts.append(first.group())
    return tuple(starts)


def _assistant_spans(text: str, header: _Header, controls: re.Pattern) -> list[tuple[int, int]]:
    """(start, end) character spans of the assistant blocks of a rendered conversation."""
    message_start = "|".join(re.escape(t) for t in (header.message_start, *header.other_starts))
    starts = [m.start() for m in re.finditer(message_start, text)] + [len(text)]
    spans: list[tuple[int, int]] = []
    block_start = None
    for here, after in zip(starts, starts[1:], strict=False):
        is_assistant = text.startswith(header.assistant, here)
        if is_assistant and block_start is None:
            block_start = here + _common_prefix(header.prompt, text[here:after])
        if block_start is not None and (not is_assistant or after == len(text)):
            end = here if not is_assistant else after
            marker_ends = [m.end() for m in controls.finditer(text, block_start, end)]
            spans.append((block_start, marker_ends[-1] if marker_ends else end))
            block_start = None
    return spans


def _prefix_spans(
    messages: list[dict[str, Any]],
    template: ChatTemplate,
    text: str,
    controls: re.Pattern,
    tools: list | None,
    where: str,
) -> list[tuple[int, int]]:
    """Spans of the assistant turns by prefix rendering, for templates without control-token headers."""
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        head = template.render(messages[:k], add_generation_prompt=True, tools=tools)
        upto = template.render(messages[: k + 1], tools=tools)
        if not (text.startswith(head) and text.startswith(upto)):
            raise DataError(
                f"chat template {template.origin}: at {where} its messages start with no control token and "
                "a rendered prefix of the conversation is not a prefix of the whole, so turn boundaries "
                "cannot be found; use sft.loss_on = 'all', or mark answers with {% generation %}"
            )
        marker_ends = [m.end() for m in controls.finditer(text, len(head), len(upto))]
        spans.append((len(head), marker_ends[-1] if marker_ends else len(upto)))
    return spans


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token that holds a character of a span."""
    starts = np.array([s for s, _ in offsets], dtype=np.int64).reshape(-1)
    ends = np.maximum(np.array([e for _, e in offsets], dtype=np.int64).reshape(-1), starts + 1)
    trained = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        trained |= (starts < b) & (ends > a)
    return trained


def trained_spans(
    messages: list[dict[str, Any]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    tools: list | None = None,
    where: str = "a conversation",
) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character spans of its trained blocks, in order."""
    text, spans = template.render_marked(messages, tools=tools)
    if template.has_generation_blocks:
        return text, spans
    header = _header(template, tokenizer, json.dumps(tools, sort_keys=True))
    controls = _control_texts(tokenizer)
    if header is None:
        return text, _prefix_spans(messages, template, text, controls, tools, where)
    return text, _assistant_spans(text, header, controls)


def tokenize_conversation(
    messages: list[dict[str, Any]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    loss_on: str,
    where: str,
    *,
    tools: list | None = None,
) -> Conversation:
    """Tokens of `messages` as `template` renders them (with the row's `tools`), and the targets
    `loss_on` trains on: every assistant block, the last one, or all tokens."""
    if loss_on not in LOSS_ON:
        raise DataError(f"sft: loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    if loss_on == "all":
        whole = tokenizer.encode_chat(template.render(messages, tools=tools))
        return Conversation(np.asarray(whole, dtype=np.int64), np.ones(len(whole), dtype=bool))
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(f"dataset: {where}: the conversation has no assistant turn to train on")
    text, spans = trained_spans(messages, template, tokenizer, tools, where)
    if not spans:
        raise DataError(
            f"dataset: {where}: chat template {template.origin} rendered no assistant block to train on"
        )
    if loss_on == "last":
        spans = spans[-1:]
    whole, offsets = tokenizer.encode_chat_with_offsets(text)
    return Conversation(np.asarray(whole, dtype=np.int64), _token_mask(offsets, spans))

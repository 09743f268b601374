"""(Titan) The [sft] section: how chat rows (`training.dataset = "chat"`) become fine-tuning examples.

torchtitan 0.2.2 has no fine-tuning data, and its later versions configure it only in Python; these
fields are Titan's own. They apply to training and validation alike, so both use the same masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from titan_data import CHAT, PREFERENCE
from titan_train.config.fields import opt
from titan_train.errors import ConfigError


def is_chat(section: Any) -> bool:
    """Whether a `[training]` or `[validation]` section reads chat rows (`dataset = "chat"`): the one place
    that tells a fine-tuning run's data from text."""
    return section.dataset == CHAT


def is_preference(section: Any) -> bool:
    """Whether a `[training]` or `[validation]` section reads preference pairs (`dataset = "preference"`):
    the one place that tells pairs from other rows."""
    return section.dataset == PREFERENCE


def renders_chat_template(section: Any) -> bool:
    """Whether a section's rows are rendered with the chat template: chat rows (`is_chat`) and preference
    pairs (`is_preference`; see [sft] and [preference])."""
    return is_chat(section) or is_preference(section)


FIELD_NAME = (r"[^\s]+", "a field name without spaces")


def template_variables(text: str) -> dict[str, Any]:
    """`sft.template_variables` as the dict the chat template is rendered with; ConfigError if not a JSON object."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"config: sft.template_variables is not JSON ({err.msg}); write an object such as "
            '\'{"enable_thinking": false, "date_string": "26 Jul 2024"}\''
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"config: sft.template_variables must be a JSON object of name: value, got {type(value).__name__}"
        )
    return value


@dataclass
class Sft:
    format: str = opt(
        "auto",
        "(Titan) Chat row layout: messages (role/content turns), prompt_completion, alpaca "
        "(instruction/input/output), or auto (by each row's fields)",
        choices=("auto", "messages", "prompt_completion", "alpaca"),
    )
    messages_field: str = opt("messages", "(Titan) Field holding a row's list of turns", pattern=FIELD_NAME)
    prompt_field: str = opt(
        "prompt", "(Titan) Field holding the prompt of a prompt/completion row", pattern=FIELD_NAME
    )
    completion_field: str = opt(
        "completion", "(Titan) Field holding the completion of a prompt/completion row", pattern=FIELD_NAME
    )
    loss_on: str = opt(
        "assistant",
        "(Titan) Tokens trained on: every assistant turn (its content and end-of-turn token), the last "
        "assistant turn only, or all tokens",
        choices=("assistant", "last", "all"),
    )
    packing: bool = opt(
        True,
        "(Titan) Pack whole conversations into training.seq_len rows (positions restart, attention stays "
        "within each); false: one conversation per row, padded (needed by a model family that builds its own "
        "attention masks, which do not take packed positions yet; the refusal at start names the families that do)",
    )
    overlong: str = opt(
        "truncate",
        "(Titan) A conversation longer than seq_len: truncate it to seq_len or drop it (counted in the log)",
        choices=("truncate", "drop"),
    )
    bad_rows: str = opt(
        "stop",
        "(Titan) A malformed row (missing field, unknown role, non-string turn, template error): stop "
        "(exit 2, naming file, row and field) or skip it (counted in the log)",
        choices=("stop", "skip"),
    )
    chat_template: str | None = opt(
        None,
        "(Titan) Jinja chat template file overriding the tokenizer's (chat_template.jinja or "
        "tokenizer_config.json in model.hf_assets_path)",
        path="a jinja file",
    )
    template_variables: str = opt(
        "",
        "(Titan) JSON object of variables the chat template is rendered with, as transformers' "
        "apply_chat_template(**kwargs) passes them: enable_thinking, date_string, reasoning_effort, ... "
        "and tools (for rows without a 'tools' field); empty: none",
        check=template_variables,
    )

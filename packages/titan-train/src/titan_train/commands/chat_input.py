"""`generate --chat`: prompts and messages files as conversations, rendered with the run's chat template.

The template is the one training used (`sft.chat_template`, else the tokenizer's in
`model.hf_assets_path`), so a fine-tuned model is prompted the way it learned to answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_data import DataError, RowFields, Tokenizer, chat_prompt, load_chat_template
from titan_data.chat.rows import row_to_messages
from titan_train.config.sft_section import template_variables
from titan_train.errors import ConfigError
from titan_train.wiring.data import BUNDLED_TOKENIZER

_MESSAGES = RowFields(format="messages")


def read_messages_file(path: str | Path) -> list[list[dict[str, str]]]:
    """Conversations of a JSONL file, one a line: `{"messages": [...]}` or a bare list of turns."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"generate: --messages-file {path} does not exist")
    conversations = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"generate: {path} line {number} is not JSON ({err.msg})") from None
        row = {"messages": row} if isinstance(row, list) else row
        try:
            conversations.append(row_to_messages(row, _MESSAGES, f"{path} line {number}"))
        except DataError as err:
            raise ConfigError(f"generate: {err}") from None
    return conversations


def chat_prompts(
    config, tokenizer: Tokenizer, conversations: list[list[dict[str, str]]]
) -> tuple[list[list[int]], int]:
    """Each conversation's prompt ids (ending with the assistant header) and the template's end-of-turn id."""
    try:
        template = load_chat_template(
            config.model.hf_assets_path or BUNDLED_TOKENIZER,
            config.sft.chat_template,
            template_variables(config.sft.template_variables),  # as training rendered (enable_thinking, ...)
        )
        prompts = [chat_prompt(messages, template, tokenizer) for messages in conversations]
    except DataError as err:
        raise ConfigError(f"generate --chat: {err}") from None
    return [p.ids for p in prompts], prompts[0].end_of_turn_id

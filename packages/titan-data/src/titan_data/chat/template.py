"""The model's own chat template (jinja), found where Hugging Face keeps it and rendered sandboxed.

A template comes from an override file, else `chat_template.jinja` or the `chat_template` entry of
`tokenizer_config.json` in the model's assets folder. It is rendered as transformers renders it
(trim_blocks, lstrip_blocks, the loop-controls extension, `raise_exception`, `tojson`,
`strftime_now`), with the special tokens the folder declares, in jinja's immutable sandbox: a
template is code shipped with a download, so it may not touch Python objects or mutate its input.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan_data.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    # transformers' tojson: no HTML escaping, unicode kept, as chat templates expect
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


class ChatTemplate:
    """A jinja chat template with the special tokens it is rendered with; `render(messages)` gives text."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise DataError(f"chat template: {origin} is not a valid jinja template: {err}") from None
        self.source, self.special_tokens, self.origin = source, special_tokens, origin

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as the model reads it; DataError when the template refuses it."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except Exception as err:  # a template may raise anything jinja or its own raise_exception throws
            raise DataError(f"chat template {self.origin} failed to render: {err}") from None


def _config_template(config: dict, path: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: the "default" one is the chat template
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise DataError(f"chat template: {path} has a 'chat_template' that is not a string")
    return value


def load_chat_template(assets: str | Path, override: str | Path | None = None) -> ChatTemplate:
    """The template of the tokenizer folder `assets` (or the file `override`), with its special tokens."""
    folder = Path(assets)
    if folder.is_file():
        folder = folder.parent
    config: dict = {}
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"chat template: cannot read {config_path}: {err}") from None
    specials = {k: _token_text(config.get(k)) or "" for k in SPECIAL_TOKEN_KEYS}
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"chat template: override file {path} does not exist (sft.chat_template)")
        return ChatTemplate(path.read_text(encoding="utf-8"), specials, str(path))
    if (folder / TEMPLATE_FILE).is_file():
        return ChatTemplate(
            (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), specials, str(folder / TEMPLATE_FILE)
        )
    source = _config_template(config, config_path)
    if source is None:
        raise DataError(
            f"chat template: the tokenizer at {folder} has none (no {TEMPLATE_FILE}, no 'chat_template' in "
            f"{CONFIG_FILE}); set sft.chat_template to a jinja file, or use a model's instruct tokenizer"
        )
    return ChatTemplate(source, specials, str(config_path))

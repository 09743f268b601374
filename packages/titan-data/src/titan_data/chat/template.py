"""The model's own chat template (jinja), found where Hugging Face keeps it and rendered sandboxed.

A template comes from an override file, else `chat_template.jinja` or the `chat_template` entry of
`tokenizer_config.json` in the model's assets folder. It is rendered as transformers renders it
(trim_blocks, lstrip_blocks, the loop-controls extension, `raise_exception`, `tojson`,
`strftime_now`), with the special tokens the folder declares, in jinja's immutable sandbox: a
template is code shipped with a download, so it may not touch Python objects or mutate its input.

What transformers' `apply_chat_template` takes besides the messages reaches the template the same
way: a row's `tools`, and the variables a user sets (`enable_thinking`, `date_string`,
`reasoning_effort`, ...; `sft.template_variables`). A `{% generation %}...{% endgeneration %}` block
marks the text a model is trained to write, as in transformers' `return_assistant_tokens_mask`;
`render_marked` returns those spans with the text.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan_data.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# What the renderer itself passes; a user's variable may not replace them.
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "documents")
# Private-use characters that bracket a {% generation %} block's output while rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKS = re.compile(f"({_OPEN}|{_CLOSE})")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    # transformers' tojson: no HTML escaping, unicode kept, as chat templates expect
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: the block's output, bracketed by private-use marks."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_bracket"), [], [], body).set_lineno(lineno)

    def _bracket(self, caller) -> str:
        return _OPEN + caller() + _CLOSE


class ChatTemplate:
    """A jinja chat template with the special tokens and variables it is rendered with; `render(messages)`
    gives text."""

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str],
        origin: str,
        variables: dict[str, Any] | None = None,
    ):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise DataError(f"chat template: {origin} is not a valid jinja template: {err}") from None
        variables = dict(variables or {})
        reserved = sorted(set(variables) & set(RESERVED_VARIABLES))
        if reserved:
            raise DataError(
                f"sft: template_variables may not set {', '.join(reserved)}; the renderer passes them"
            )
        self.source, self.special_tokens, self.origin = source, special_tokens, origin
        self.variables = variables
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None) -> str:
        """The raw render, {% generation %} marks included."""
        variables = {**self.special_tokens, **self.variables}
        if tools is not None:
            variables["tools"] = tools
        variables.setdefault("tools", None)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, documents=None, **variables
            )
        except Exception as err:  # a template may raise anything jinja or its own raise_exception throws
            raise DataError(f"chat template {self.origin} failed to render: {err}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: list | None = None,
    ) -> str:
        """The conversation as the model reads it (`tools`: the row's, else `template_variables`'s);
        DataError when the template refuses it."""
        text = self._render(messages, add_generation_prompt, tools)
        return text.replace(_OPEN, "").replace(_CLOSE, "")

    def render_marked(
        self, messages: list[dict[str, Any]], *, tools: list | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the (start, end) character spans of its {% generation %}
        blocks, in order; no spans for a template without them."""
        raw = self._render(messages, False, tools)
        if not self.has_generation_blocks:
            return raw, []
        text, spans, start = [], [], None
        pos = 0
        for piece in _MARKS.split(raw):
            if piece == _OPEN:
                start = pos
            elif piece == _CLOSE:
                if start is None:
                    raise DataError(
                        f"chat template {self.origin}: a conversation holds the private-use character U+E001, "
                        "which marks {% generation %} blocks while rendering; remove it from the data"
                    )
                spans.append((start, pos))
                start = None
            else:
                text.append(piece)
                pos += len(piece)
        return "".join(text), spans


def _config_template(config: dict, path: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: the "default" one is the chat template
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise DataError(f"chat template: {path} has a 'chat_template' that is not a string")
    return value


def load_chat_template(
    assets: str | Path, override: str | Path | None = None, variables: dict[str, Any] | None = None
) -> ChatTemplate:
    """The template of the tokenizer folder `assets` (or the file `override`), with its special tokens
    and the user's template `variables`."""
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
        return ChatTemplate(path.read_text(encoding="utf-8"), specials, str(path), variables)
    if (folder / TEMPLATE_FILE).is_file():
        return ChatTemplate(
            (folder / TEMPLATE_FILE).read_text(encoding="utf-8"),
            specials,
            str(folder / TEMPLATE_FILE),
            variables,
        )
    source = _config_template(config, config_path)
    if source is None:
        raise DataError(
            f"chat template: the tokenizer at {folder} has none (no {TEMPLATE_FILE}, no 'chat_template' in "
            f"{CONFIG_FILE}); set sft.chat_template to a jinja file, or use a model's instruct tokenizer"
        )
    return ChatTemplate(source, specials, str(config_path), variables)

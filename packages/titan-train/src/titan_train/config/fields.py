"""How a config field is declared: a default, a one-line help, and the values it accepts.

The accepted values live with the field so that `titan-train --help` shows them and one start-up check
(`titan_train.config.validate`) enforces every field the same way.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import field
from typing import Any

from titan_train.config.custom_module import is_section

# Upper bounds far above any real run, yet low enough to catch a typo (a few extra digits).
MAX_STEPS = 1_000_000_000
MAX_RANKS = 1 << 20
MAX_SEQUENCES = 1 << 24  # sequences per batch
MAX_SEQ_LEN = 1 << 24  # tokens per sequence; the model's own context is checked too
MAX_SECONDS = 7 * 24 * 3600
MAX_LAYERS = 10_000
# Patterns: (regular expression the whole value matches, how it reads).
MODULE_NAME = (r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", "an importable module name")
SPLIT_NAME = (r"[\w.-]+", "a split name (train, test, validation, ...)")
CONFIG_NAME = (r"[\w.-]+", "a dataset configuration name (main, socratic, en, ...)")
MODULE_PATH = (r"[\w*]+(\.[\w*]+)*", "a module name as named_modules() spells it")

# Each bound: its `opt` keyword, how it reads, and whether a value falls outside it.
BOUNDS = (
    ("minimum", "at least", operator.lt),
    ("above", "above", operator.le),
    ("maximum", "at most", operator.gt),
    ("below", "below", operator.ge),
)


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    below: float | None = None,
    sentinels: tuple[Any, ...] = (),
    nonempty: bool = False,
    pattern: tuple[str, str] | None = None,
    check: Callable[[Any], None] | None = None,
    path: str | None = None,
    needed_if: str | None = None,
) -> Any:
    """A dataclass field with its help text (shown by `--help`) and the values it accepts.

    `choices`: the allowed values (of each item, for a list). `minimum`/`maximum` are inclusive bounds,
    `above`/`below` exclusive ones; `sentinels` are the documented special values outside them (-1:
    derive it, 0: off). `nonempty`: a string that must not be empty; `pattern`: (a regular expression the
    whole string matches, how it reads); `check(value)` raises ConfigError for rules no range can say. `path` says what
    the file or folder must be, and that it must exist once set; with `needed_if` (a dotted boolean
    field) only when that switch is on.
    """
    metadata = {
        "help": help,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "above": above,
        "below": below,
        "sentinels": sentinels,
        "nonempty": nonempty,
        "pattern": pattern,
        "check": check,
        "path": path,
        "needed_if": needed_if,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def describe_rule(metadata: Any) -> str:
    """The accepted values in words, for `--help` and error messages: `at least 1, or -1`."""
    if metadata.get("choices"):
        return "one of: " + ", ".join(map(str, metadata["choices"]))
    bounds = [f"{words} {number(metadata[key])}" for key, words, _ in BOUNDS if metadata.get(key) is not None]
    parts = [" and ".join(bounds)] if bounds else []
    if metadata.get("nonempty"):
        parts.append("not empty")
    if metadata.get("pattern"):
        parts.append(metadata["pattern"][1])
    if metadata.get("path"):
        parts.append(f"{metadata['path']}, which must exist")
    text = ", ".join(parts)
    if text and metadata.get("sentinels"):
        text += ", or " + " or ".join(map(repr, metadata["sentinels"]))
    return text


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(`T`, True) for `T | None`; (`tp`, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, resolved type, field) for every leaf field of a config dataclass, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if is_section(tp):
            yield from iter_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp, f


def get_value(config: Any, dotted: str) -> Any:
    """The value of `section.field` in `config`."""
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def number(x: float) -> str:
    """`x` as a bound reads: integers in full, floats short (`1e-08`)."""
    return f"{x:g}" if isinstance(x, float) else str(x)

"""How a config field is declared: a default, a one-line help, and optional allowed values."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, choices: tuple[Any, ...] | None = None) -> Any:
    """A dataclass field with its help text (shown by `--help`) and, optionally, its allowed values."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)

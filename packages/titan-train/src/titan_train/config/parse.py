"""Fill a JobConfig from defaults, then a TOML file, then dotted CLI flags, refusing unknown keys."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any

from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def iter_fields(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, resolved type, field) for every leaf field of a config dataclass, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from iter_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp, f


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """`value` (from TOML or a CLI string) converted to the field's type, or a ConfigError naming it."""
    inner, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"config: {name} cannot be empty")
    origin = typing.get_origin(inner)
    if origin is list:
        (item_type,) = typing.get_args(inner) or (str,)
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"config: {name} expects a list, got {value!r}")
        return [_coerce(item, item_type, name) for item in items]
    try:
        if inner is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in _TRUE | _FALSE:
                return str(value).lower() in _TRUE
            raise ValueError
        if inner is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if inner is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if inner is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config: {name} expects {getattr(inner, '__name__', inner)}, got {value!r}") from None
    return value


def _set(config: Any, dotted: str, value: Any) -> None:
    *path, leaf = dotted.split(".")
    target = config
    for part in path:
        target = getattr(target, part)
    setattr(target, leaf, value)


def _unknown_key_error(key: str, section: str, known: list[str]) -> ConfigError:
    where = f"[{section}]" if section else "the top level"
    guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean '{guess[0]}'?" if guess else f"; valid names: {', '.join(known)}"
    return ConfigError(f"config: unknown key '{key}' in {where}{hint}")


def apply_toml(config: Any, data: dict[str, Any], cls: type, section: str = "") -> None:
    """Set fields of `config` from a parsed TOML table, recursing into sub-sections."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{section}.{key}" if section else key
        if key not in names:
            raise _unknown_key_error(key, section, names)
        tp = hints[key]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config: [{dotted}] must be a table, got {value!r}")
            apply_toml(getattr(config, key), value, tp, dotted)
        elif isinstance(value, dict):
            raise ConfigError(f"config: {dotted} is a field, not a section")
        else:
            setattr(config, key, _coerce(value, tp, dotted))


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config: --job.config_file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config: {path} is not valid TOML: {err}") from None


def build_parser(cls: type = JobConfig) -> argparse.ArgumentParser:
    """An argparse parser with one `--section.field` flag per config field (booleans as flags)."""
    parser = argparse.ArgumentParser(
        prog="titan-train",
        description="Train a Llama model. Precedence: CLI flags over the TOML file over defaults.",
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dotted, tp, f in iter_fields(cls):
        section = dotted.rsplit(".", 1)[0]
        group = groups.setdefault(section, parser.add_argument_group(f"[{section}]"))
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" (one of: {', '.join(map(str, f.metadata['choices']))})"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": dotted, "help": help_text or " ", "default": argparse.SUPPRESS}
        if _unwrap_optional(tp)[0] is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        group.add_argument(f"--{dotted}", **kwargs)
        group._group_actions[-1].help = f"{kwargs['help']} (default: {default!r})"
    return parser


def _check_choices(config: Any, cls: type) -> None:
    for dotted, _, f in iter_fields(cls):
        choices = f.metadata.get("choices")
        value = config
        for part in dotted.split("."):
            value = getattr(value, part)
        if choices and value not in choices:
            raise ConfigError(f"config: {dotted} = {value!r} is not one of {', '.join(map(repr, choices))}")


def load_job_config(argv: list[str] | None = None, cls: type = JobConfig) -> Any:
    """The config for `argv`: defaults, then `--job.config_file`, then the other flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(cls)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        known = [f"--{name}" for name, _, _ in iter_fields(cls)]
        guess = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f"; did you mean '{guess[0]}'?" if guess else "; see titan-train --help"
        raise ConfigError(f"config: unknown flag '{flag}'{hint}")
    config = cls()
    overrides = vars(args)
    config_file = overrides.get("job.config_file")
    if config_file:
        apply_toml(config, read_toml(config_file), cls)
    types_by_name = {name: tp for name, tp, _ in iter_fields(cls)}
    for dotted, raw in overrides.items():
        _set(config, dotted, _coerce(raw, types_by_name[dotted], dotted))
    _check_choices(config, cls)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)

"""Fill a JobConfig from defaults, then a TOML file, then dotted CLI flags, refusing unknown keys."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any

from titan_train.config.custom_module import is_section, load_custom_schema
from titan_train.config.fields import describe_rule, iter_fields, unwrap_optional
from titan_train.config.migrate import migrate_argv, migrate_converter_names, migrate_toml
from titan_train.config.schema import JobConfig
from titan_train.config.validate import validate_config
from titan_train.errors import ConfigError
from titan_train.registry import model_family_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """`value` (from TOML or a CLI string) converted to the field's type, or a ConfigError naming it."""
    inner, optional = unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"config: {name} cannot be empty")
    if typing.get_origin(inner) is list:
        (item_type,) = typing.get_args(inner) or (str,)
        nested = typing.get_origin(item_type) is list
        if isinstance(value, str):
            # CLI lists: "a,b,c"; lists of lists: "a,b;c,d".
            items: Any = [s.strip() for s in value.split(";" if nested else ",") if s.strip()]
        else:
            items = value
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
        raise ConfigError(f"config: {name} expects {_type_name(inner)}, got {value!r}") from None
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


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
        if is_section(tp):
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


# The subcommands `titan_train.cli.run` dispatches: (name, arguments, what it does), for `--help`.
SUBCOMMANDS = (
    ("report", "DUMP_FOLDER", "draws a run's loss, throughput, MFU and memory curves"),
    (
        "dry-run",
        "--ngpu N ...",
        "checks a config and its layout for N GPUs without GPUs, with a memory estimate",
    ),
    ("check", "--ngpu N ...", "checks a config and its layout for N ranks before a launcher starts them"),
    ("generate", "--checkpoint DIR ...", "generates text from a checkpoint (DCP or Hugging Face)"),
    ("eval", "--checkpoint DIR ...", "scores a checkpoint: perplexity and lm-eval tasks"),
)


def build_parser(cls: type = JobConfig) -> argparse.ArgumentParser:
    """An argparse parser with one `--section.field` flag per config field.

    Booleans are flags (`--checkpoint.enable`, or `--checkpoint.enable false`) with a negated
    form (`--checkpoint.no_enable`); lists are comma-separated.
    """
    commands = " | ".join(f"{name} {args}" for name, args, _ in SUBCOMMANDS)
    parser = argparse.ArgumentParser(
        prog="titan-train",
        usage=f"titan-train [--job.config_file FILE] [--section.field VALUE ...]\n       titan-train {{{commands}}}",
        description=f"Titan: PyTorch-native training of LLMs ({', '.join(model_family_names())}) on torchtitan's "
        "TOML configs, every parallelism, exact resume. Precedence: CLI flags over the TOML file over defaults. "
        "Subcommands (each with its own --help): "
        + "; ".join(f"'{name}' {what}" for name, _, what in SUBCOMMANDS)
        + ".",
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dotted, tp, f in iter_fields(cls):
        section = dotted.rsplit(".", 1)[0]
        group = groups.setdefault(section, parser.add_argument_group(f"[{section}]"))
        help_text = f.metadata.get("help", "")
        accepted = describe_rule(f.metadata)
        if accepted:
            help_text += f" ({accepted})"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS}
        kwargs["help"] = f"{help_text} (default: {default!r})".strip()
        inner = unwrap_optional(tp)[0]
        if inner is bool:
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif typing.get_origin(inner) is list:
            kwargs["metavar"] = "A,B;C" if typing.get_origin(typing.get_args(inner)[0]) is list else "A,B"
        else:
            kwargs["metavar"] = {int: "INT", float: "FLOAT"}.get(inner, "STR")
        group.add_argument(f"--{dotted}", **kwargs)
        if inner is bool:
            negated = f"--{section}.no_{dotted.rsplit('.', 1)[1]}"
            group.add_argument(
                negated,
                dest=dotted,
                action="store_const",
                const="false",
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    return parser


def _option_value(argv: list[str], flag: str) -> str | None:
    """The last value given to `flag` in `argv` (`--flag V` or `--flag=V`), before argparse runs."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def load_job_config(
    argv: list[str] | None = None, cls: type = JobConfig, *, check_paths: bool = False
) -> Any:
    """The config for `argv`: defaults, then `--job.config_file`, then the other flags, validated.

    Keys of older torchtitan schemas are migrated with a warning each; `job.custom_config_module`
    (from the CLI or the TOML file) extends `cls` before anything is parsed. `check_paths`: the files
    and folders a run reads must exist here (the trainer asks for it; a config read elsewhere need not).
    """
    argv = migrate_argv(list(sys.argv[1:] if argv is None else argv), lambda token: token.startswith("--"))
    config_file = _option_value(argv, "--job.config_file")
    toml = migrate_toml(read_toml(config_file), str(config_file)) if config_file else {}
    custom = _option_value(argv, "--job.custom_config_module") or toml.get("job", {}).get(
        "custom_config_module"
    )
    if custom:
        cls = load_custom_schema(cls, custom)

    parser = build_parser(cls)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=", 1)[0]
        known = [f"--{name}" for name, _, _ in iter_fields(cls)]
        guess = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f"; did you mean '{guess[0]}'?" if guess else "; see titan-train --help"
        raise ConfigError(f"config: unknown flag '{flag}'{hint}")
    config = cls()
    apply_toml(config, toml, cls)
    types_by_name = {name: tp for name, tp, _ in iter_fields(cls)}
    for dotted, raw in vars(args).items():
        _set(config, dotted, _coerce(raw, types_by_name[dotted], dotted))
    config.model.converters = migrate_converter_names(config.model.converters)
    validate_config(config, cls, check_paths=check_paths)
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)

"""`job.custom_config_module`: a user's module adds sections or fields to the schema without forking it."""

from __future__ import annotations

import dataclasses
import importlib
import typing

from titan_train.errors import ConfigError


def is_section(tp: typing.Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default, metadata=f.metadata)
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    raise ConfigError(f"config: custom field '{f.name}' needs a default value")


def merge_schema(base: type, extra: type) -> type:
    """A subclass of `base` that also has `extra`'s fields; sections both define are merged field by field."""
    if issubclass(extra, base):
        return extra
    base_hints, extra_hints = typing.get_type_hints(base), typing.get_type_hints(extra)
    fields = []
    for f in dataclasses.fields(extra):
        tp = extra_hints[f.name]
        if is_section(base_hints.get(f.name)) and is_section(tp):
            merged = merge_schema(base_hints[f.name], tp)
            fields.append((f.name, merged, dataclasses.field(default_factory=merged)))
        else:
            fields.append((f.name, tp, _copy_field(f)))
    return dataclasses.make_dataclass(base.__name__, fields, bases=(base,))


def import_user_module(setting: str, module_name: str) -> typing.Any:
    """The module a user names in `setting`, or a ConfigError naming the setting and the fix."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"config: {setting} '{module_name}' cannot be imported ({err}); put its folder on PYTHONPATH or install it"
        ) from None


def load_custom_schema(base: type, module_name: str) -> type:
    """`base` extended by the `JobConfig` dataclass of `module_name`."""
    module = import_user_module("job.custom_config_module", module_name)
    extra = getattr(module, "JobConfig", None)
    if not is_section(extra):
        raise ConfigError(
            f"config: job.custom_config_module '{module_name}' must define a dataclass named JobConfig "
            "whose fields are the sections to add"
        )
    return merge_schema(base, extra)

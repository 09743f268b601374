"""Rules across the data fields: a mixture, its weights, epochs and a held-out share, each refused in one
line where it cannot apply."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from titan_data import CHAT, PREFERENCE, PROMPTS
from titan_train.config.sft_section import is_preference
from titan_train.errors import ConfigError

TOKEN_SHARDS = "token_shards"


def default_steps(config: Any) -> int:
    """training.steps as the schema leaves it: a value other than this one was given."""
    return next(f.default for f in fields(type(config.training)) if f.name == "steps")


def data_choices_fit(config: Any) -> None:
    t, v = config.training, config.validation
    if is_preference(t):
        given = [
            name
            for name, value in (
                ("training.dataset_mixture", t.dataset_mixture),
                ("training.dataset_split", t.dataset_split),
                ("training.epochs", t.epochs),
                ("validation.holdout_share", v.holdout_share),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"config: {', '.join(given)} not supported with training.dataset = 'preference' yet: give the pairs "
                "as one training.dataset_path (a file or folder of the split you want) and set training.steps"
            )
    if t.dataset_config:
        hub_config_fits(t)
    if t.dataset_mixture:
        if t.dataset_path:
            raise ConfigError(
                "config: training.dataset_mixture and training.dataset_path both name the data; put every path "
                "in dataset_mixture and leave dataset_path unset"
            )
        if len(t.dataset_mixture) < 2:
            raise ConfigError(
                "config: training.dataset_mixture needs at least two paths; for one, set training.dataset_path"
            )
        if t.dataset == TOKEN_SHARDS:
            raise ConfigError(
                "config: training.dataset_mixture mixes documents, and training.dataset = 'token_shards' holds "
                "packed tokens; mix the text sources, or tokenize the mixture into one shard folder"
            )
    if t.dataset_weights and len(t.dataset_weights) != len(t.dataset_mixture):
        raise ConfigError(
            f"config: training.dataset_weights has {len(t.dataset_weights)} weights for the "
            f"{len(t.dataset_mixture)} paths of training.dataset_mixture; give one weight per path"
        )
    if t.epochs and t.dataset == "c4" and not t.dataset_path:
        raise ConfigError(
            "config: training.epochs needs a finite local dataset, and training.dataset = 'c4' streams 1,024 "
            "files from the hub; set training.steps instead"
        )
    if v.holdout_share:
        if not v.enable:
            raise ConfigError("config: validation.holdout_share needs validation.enable = true")
        if v.dataset_path or v.dataset_split:
            raise ConfigError(
                "config: validation.holdout_share validates on held-out training rows, and validation.dataset_path "
                "or validation.dataset_split names other data; leave them unset"
            )
        if t.dataset == TOKEN_SHARDS or t.dataset_mixture:
            raise ConfigError(
                "config: validation.holdout_share splits one text or chat source by row; it does not apply to "
                "training.dataset = 'token_shards' or to a training.dataset_mixture"
            )


def hub_config_fits(t: Any) -> None:
    """training.dataset_config names a configuration of rows read by hub id: chat, preference or prompts
    from one dataset_path, a hub id or a local copy of its repository (whose README names the
    configurations), not a plain file."""
    if t.dataset not in (CHAT, PREFERENCE, PROMPTS):
        raise ConfigError(
            f"config: training.dataset_config applies to chat, preference or prompts rows read by hub id, not "
            f"training.dataset = {t.dataset!r}; remove it"
        )
    if t.dataset_mixture or not t.dataset_path:
        raise ConfigError(
            "config: training.dataset_config names a configuration of one hub dataset: give its id as "
            "training.dataset_path (not a dataset_mixture)"
        )
    if Path(t.dataset_path).is_file():
        raise ConfigError(
            f"config: training.dataset_config set, but training.dataset_path {t.dataset_path} is a file, which has "
            "no configurations; remove dataset_config, or give a hub dataset id or a local copy of its repository"
        )

"""The training objectives by name: the built-in ones and those a user's module registers.

`objective_name(config)` is the one place that decides which objective a run trains: `training.objective`,
or with "auto" preference pairs train `preference`, prompts `grpo` and every other dataset
`next_token`. A module named by
`experimental.custom_import` can `register_objective("name", factory)` and set `training.objective = "name"`.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_train.config.grpo_section import is_prompts
from titan_train.config.sft_section import is_preference
from titan_train.errors import ConfigError
from titan_train.objectives.grpo import GRPO
from titan_train.objectives.next_token import NextToken
from titan_train.objectives.preference import Preference
from titan_train.objectives.protocol import ObjectiveContext, TrainingObjective

AUTO = "auto"
ObjectiveFactory = Callable[[ObjectiveContext], TrainingObjective]
OBJECTIVES: dict[str, ObjectiveFactory] = {"next_token": NextToken, "preference": Preference, "grpo": GRPO}


def register_objective(name: str, factory: ObjectiveFactory) -> None:
    """Make `factory(context)` the objective `training.objective = name` trains."""
    if name == AUTO or not name:
        raise ValueError(f"an objective cannot be registered as {name!r}")
    OBJECTIVES[name] = factory


def objective_name(config) -> str:
    """The run's objective, decided once (ConfigError for a name nothing registered)."""
    name = config.training.objective
    if name == AUTO:
        if is_prompts(config.training):
            return "grpo"
        return "preference" if is_preference(config.training) else "next_token"
    if name not in OBJECTIVES:
        raise ConfigError(
            f"config: training.objective = {name!r} is not a registered objective (registered: "
            f"{', '.join(sorted(OBJECTIVES))}); register it with titan_train.objectives.registry."
            "register_objective in a module experimental.custom_import names"
        )
    return name


def build_objective(name: str, ctx: ObjectiveContext) -> TrainingObjective:
    return OBJECTIVES[name](ctx)

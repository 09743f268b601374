"""Model families Titan can train: the one place that ties a model name to its parts.

`register_model_family(ModelFamily(...))` adds a family; `register_flavor(family, name, args)` adds a
shape to one (tests, benchmarks and `experimental.custom_import` modules use these, never the dicts);
`get_model_family(name)` is how the rest of titan-train reaches a family: the resolve step
(`titan_train.plan`), the trainer, checkpointing and the Hugging Face export, Hugging Face import,
generate and eval, the dry run and the memory estimate.

A family brings:
- `flavors`: flavor name -> args, a dataclass of the family's own (Llama's `ModelArgs`; an MoE or MLA
  family brings another). titan-train reads only this common surface of it:
  `dim`, `n_layers`, `n_heads`, `kv_heads`, `vocab_size`, `max_seq_len` (positions the model is built
  for), `context_len` (the longest sequence the flavor supports) and `eos_id`; and it sets
  `max_seq_len`, `eos_id` and `n_layers` with `dataclasses.replace`. Anything else (FLOPs, parameter
  counts, the weight mapping) it asks the family.
- `build(args)`: the model, called on the meta device. The model describes itself to titan-parallel
  through `titan_parallel.protocols` (`parallel_blocks`, `tp_plan`, `pipeline_units`,
  `sequence_buffers`, `init_weights`).
- `loss_fn(logits, labels)`: the mean loss over every position.
- `count_parameters(model) -> (total, embedding)` and `flops_per_token(args, total, embedding, seq_len)`.
- `hf`: its Hugging Face mapping (`HFMapping`), or None for a family without one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_models import LLAMA2_FLAVORS, LLAMA3_FLAVORS, LlamaStateDictAdapter, Transformer
from titan_train.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The flavor that takes a family's shape from a Hugging Face config.json (through the family's `hf`).
FROM_HF = "from_hf"


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@dataclass(frozen=True)
class HFMapping:
    """How a family's checkpoints map to and from Hugging Face's.

    `adapter(args, bos_id=..., eos_id=...)` returns the object titan-ckpt converts weights with
    (`to_hf`, `from_hf`, `hf_config`); `args_from_config(config_json, **overrides)` reads the args a
    `config.json` describes; `config_differences(args, config_json)` names every field in which a
    `config.json` describes another function than `args` (empty when they agree)."""

    adapter: Callable[..., Any]
    args_from_config: Callable[..., Any]
    config_differences: Callable[[Any, dict], list[str]]


def _count_embedded(model: nn.Module) -> tuple[int, int]:
    total = titan_models.count_parameters(model)
    return total, total - titan_models.count_parameters(model, exclude_embedding=True)


@dataclass(frozen=True)
class ModelFamily:
    """A model family: its flavors, how to build it, its loss, its FLOPs and its Hugging Face mapping
    (the module docstring lists what titan-train reads of a flavor's args)."""

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int, int, int], float]
    count_parameters: Callable[[nn.Module], tuple[int, int]] = _count_embedded
    loss_fn: LossFn = cross_entropy_loss
    hf: HFMapping | None = None

    def __post_init__(self) -> None:
        # A copy: the family's flavors change only through `register_flavor`, never through the dict
        # it was given (a test or benchmark assigning into titan_models.LLAMA3_FLAVORS changes nothing).
        object.__setattr__(self, "flavors", dict(self.flavors))

    def args_for(self, flavor: str, **overrides) -> Any:
        """The args of `flavor`, with `overrides` (fields of the common surface)."""
        if flavor not in self.flavors:
            raise ConfigError(
                f"config: model.flavor '{flavor}' is not a {self.name} flavor; choose one of {', '.join(self.flavors)}"
            )
        return replace(self.flavors[flavor], **overrides)


_FAMILIES: dict[str, ModelFamily] = {}


def register_model_family(family: ModelFamily, *, replace_existing: bool = False) -> ModelFamily:
    """Make `family` trainable as `model.name = family.name`; refuses a second family of one name."""
    if family.name in _FAMILIES and not replace_existing:
        raise ConfigError(
            f"registry: a model family '{family.name}' is already registered; pick another name, "
            "or pass replace_existing=True"
        )
    _FAMILIES[family.name] = family
    return family


def register_flavor(family_name: str, flavor: str, args: Any) -> None:
    """Add (or replace) the flavor `flavor` of a registered family, with `args` of the family's type."""
    family = get_model_family(family_name)
    _FAMILIES[family_name] = replace(family, flavors={**family.flavors, flavor: args})


def get_model_family(name: str) -> ModelFamily:
    """The family registered as `name`; a ConfigError naming the registered ones otherwise."""
    if name not in _FAMILIES:
        raise ConfigError(f"config: model.name '{name}' is unknown; registered: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def model_family_names() -> tuple[str, ...]:
    """The names of the registered families."""
    return tuple(_FAMILIES)


_LLAMA_HF = HFMapping(
    adapter=LlamaStateDictAdapter,
    args_from_config=titan_models.args_from_hf_config,
    config_differences=titan_models.hf_config_differences,
)
for _name, _flavors in (("llama3", LLAMA3_FLAVORS), ("llama2", LLAMA2_FLAVORS)):
    register_model_family(
        ModelFamily(_name, _flavors, Transformer, titan_models.flops_per_token, hf=_LLAMA_HF)
    )

# The mixture-of-experts families register themselves through the public function above.
import titan_train.model_families  # noqa: E402, F401

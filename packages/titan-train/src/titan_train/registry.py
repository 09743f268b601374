"""Model families Titan can train: the one place that ties a model name to its parts.

`register_model_family(ModelFamily(...))` adds a family; `register_flavor(family, name, args)` adds a
shape to one (tests, benchmarks and `experimental.custom_import` modules use these, never the dicts);
`get_model_family(name)` is how the rest of titan-train reaches a family: the resolve step
(`titan_train.plan`), the trainer, checkpointing and the Hugging Face export, Hugging Face import,
generate and eval, the dry run and the memory estimate.

A family brings:
- `flavors`: flavor name -> args, a dataclass of the family's own (a dense transformer's `ModelArgs`; an MoE
  or MLA family brings another). titan-train reads only this common surface of it:
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
- `vllm_gap(args, device_type, dtype)`: what vLLM lacks to serve its export (`titan_train.vllm_serving`), or None.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from titan_train.errors import ConfigError
from titan_train.model_families import FAMILIES
from titan_train.model_family import (  # re-exported: the registry is where users look for them
    FROM_HF,
    HFMapping,
    LossFn,
    ModelFamily,
    cross_entropy_loss,
)

__all__ = [
    "FROM_HF",
    "HFMapping",
    "LossFn",
    "ModelFamily",
    "cross_entropy_loss",
    "get_model_family",
    "model_family_names",
    "register_flavor",
    "register_model_family",
]

_FAMILIES: dict[str, ModelFamily] = {}


def register_model_family(family: ModelFamily, *, replace_existing: bool = False) -> ModelFamily:
    """Make `family` trainable as `model.name = family.name`; refuses a second family of one name."""
    if family.name in _FAMILIES and not replace_existing:
        raise ValueError(
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


# The families Titan ships (titan_train.model_families), through the same public function.
for _family in FAMILIES:
    register_model_family(_family)

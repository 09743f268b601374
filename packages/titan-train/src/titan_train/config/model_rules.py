"""The `[model]` rules across fields that the config alone decides: the order and the mix of
`model.converters`, LoRA's targets, multi-token prediction's depths and weight, and the compile backend.

They were checked where the run is built (the wiring of each feature); here they stop a run at start with
the config's other rules (`validate_config`), and the wiring builds what they let through. The family's
flavors come from the registry, so a family added there is judged without an edit here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan_train.config.converters import FLOAT8_CONVERTERS, LORA, MX_CONVERTERS, QUANTISED_CONVERTERS
from titan_train.config.schema import JobConfig
from titan_train.errors import ConfigError
from titan_train.registry import get_model_family, model_family_names

MTP_DEFAULT_WEIGHT = (
    0.1  # the published MTP schedule's lambda for its last 4.8T tokens (0.3 before); docs/mtp.md
)


def converters_fit(config: JobConfig) -> None:
    """One linear conversion at most, and LoRA's adapters after it (on the quantised layers)."""
    converters = config.model.converters
    if any(c in FLOAT8_CONVERTERS for c in converters) and any(c in MX_CONVERTERS for c in converters):
        raise ConfigError(
            "config: model.converters: quantize.linear.float8 and quantize.linear.mx both convert the linear "
            "layers; keep one of them"
        )
    if LORA not in converters:
        return
    late = [c for c in converters[converters.index(LORA) + 1 :] if c in QUANTISED_CONVERTERS]
    if late:
        raise ConfigError(
            f"config: model.converters {converters} puts lora before {late}: the adapters must sit on the "
            f"quantised layers; list lora last (model.converters = {[*[c for c in converters if c != LORA], LORA]})"
        )
    if not config.lora.target_modules:
        raise ConfigError(
            "config: lora.target_modules is empty; name the layers to adapt (e.g. q_proj, v_proj)"
        )


def takes_mtp(args: Any) -> bool:
    """Whether a family's args have multi-token-prediction depths to set."""
    return dataclasses.is_dataclass(args) and "num_mtp_layers" in {f.name for f in dataclasses.fields(args)}


def _mtp_families() -> str:
    """The registered families whose args take MTP depths, for a refusal to name."""
    names = [n for n in model_family_names() if any(map(takes_mtp, get_model_family(n).flavors.values()))]
    return ", ".join(f"model.name = {n!r}" for n in names) or "none is registered"


def mtp_fits(config: JobConfig) -> None:
    """MTP depths only for a family built with them, and their weight only with depths."""
    m = config.model
    if m.num_mtp_layers == 0:
        if m.mtp_loss_weight != MTP_DEFAULT_WEIGHT:
            raise ConfigError(
                f"config: model.mtp_loss_weight = {m.mtp_loss_weight} weighs multi-token prediction, but "
                f"model.num_mtp_layers is 0; set model.num_mtp_layers ({_mtp_families()}) or leave the weight unset"
            )
        return
    if not any(map(takes_mtp, get_model_family(m.name).flavors.values())):
        raise ConfigError(
            f"config: model.num_mtp_layers = {m.num_mtp_layers}: {m.name} has no multi-token-prediction "
            f"layers; use a family that has them ({_mtp_families()}) or set it to 0"
        )


def compile_backend_known(config: JobConfig) -> None:
    """A `compile.backend` torch knows, refused at start rather than at the first compile; after every
    field's check, so a backend an `experimental.custom_import` module registers is known by then."""
    if not config.compile.enable:
        return
    backend = config.compile.backend
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"config: compile.backend = {backend!r} is not a torch.compile backend; choose one of {', '.join(known)} "
            "or register yours (torch._dynamo.register_backend) in an experimental.custom_import module"
        )


MODEL_RULES = (converters_fit, mtp_fits, compile_backend_known)

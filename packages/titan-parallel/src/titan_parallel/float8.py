"""float8 training through torchao: swap linear layers for float8 ones before parallelizing."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from titan_parallel.errors import ParallelConfigError, UnsupportedDeviceError, check_choice

logger = logging.getLogger(__name__)

FLOAT8_RECIPES = ("tensorwise", "rowwise")

# torch._scaled_mm needs both matmul dims of the weight to be multiples of 16.
_FLOAT8_ALIGNMENT = 16


@dataclass(frozen=True)
class Float8Training:
    """float8 linear layers through torchao: torchtitan's `[quantize.linear.float8]` section.

    `fsdp_all_gather` (tensorwise only) all-gathers weights already cast to float8; `skip_fqns` stay in
    high precision; `emulate` runs the matmuls in high precision on float8-rounded values (float8
    numerics where float8 kernels are missing). `apply_float8` says more.
    """

    recipe: str = "tensorwise"
    fsdp_all_gather: bool = False
    skip_fqns: tuple[str, ...] = ("output",)
    emulate: bool = False

    def __post_init__(self) -> None:
        check_choice("float8.recipe", self.recipe, FLOAT8_RECIPES)
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ParallelConfigError(
                f"parallelism: float8.fsdp_all_gather needs float8.recipe='tensorwise' (got {self.recipe!r}); "
                "torchao all-gathers float8 weights only with one scale per tensor"
            )

    def convert(self, model: nn.Module, device_type: str) -> nn.Module:
        """Swap the eligible linear layers of `model` for float8 ones, in place, before TP and FSDP."""
        return apply_float8(
            model,
            recipe=self.recipe,
            fsdp_all_gather=self.fsdp_all_gather,
            skip_fqns=self.skip_fqns,
            device_type=device_type,
            emulate=self.emulate,
        )


def apply_float8(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    fsdp_all_gather: bool = False,
    skip_fqns: Iterable[str] = ("output",),
    device_type: str = "cpu",
    emulate: bool = False,
) -> nn.Module:
    """Replace each eligible `nn.Linear` by torchao's `Float8Linear`, in place, before TP and FSDP.

    "tensorwise" scales each tensor by one number; "rowwise" scales each row (more accurate).
    `fsdp_all_gather` (tensorwise only) all-gathers weights already cast to float8, halving FSDP
    traffic; call `precompute_float8_scales` after each optimizer step to compute their scales in
    one all-reduce. Linears named in `skip_fqns` (and under them), or whose dims are not multiples
    of 16, stay in high precision. `emulate` runs the matmuls in high precision on float8-rounded
    values (torchao's emulation): float8 numerics on devices without float8 matmuls.
    """
    if recipe not in FLOAT8_RECIPES:
        raise ParallelConfigError(
            f"parallelism: float8 recipe {recipe!r} is unknown; choose one of {list(FLOAT8_RECIPES)}"
        )
    if fsdp_all_gather and recipe != "tensorwise":
        raise ParallelConfigError(
            f"parallelism: float8 FSDP all-gather needs the 'tensorwise' recipe, got {recipe!r}; torchao "
            "casts a sharded weight with one scale per tensor only"
        )
    if not emulate:
        check_float8_device(device_type, recipe=recipe)
        if device_type == "cpu":
            logger.warning(
                "float8 on CPU without emulation runs torch's reference float8 matmul, minutes per step (a "
                "debug-model step took 7 minutes); add --quantize.linear.float8.emulate to run the matmuls in "
                "high precision on float8-rounded values, or train float8 on a CUDA GPU"
            )
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    config = dataclasses.replace(config, emulate=emulate)
    skip = tuple(skip_fqns)

    def eligible(module: nn.Module, fqn: str) -> bool:
        if any(fqn == s or fqn.startswith(f"{s}.") for s in skip):
            return False
        return all(d % _FLOAT8_ALIGNMENT == 0 for d in module.weight.shape)

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    logger.info(
        "float8 %s: %d linear layers converted (FSDP float8 all-gather: %s, emulated: %s)",
        recipe,
        n,
        fsdp_all_gather,
        emulate,
    )
    return model


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step, compute the float8 scales of FSDP-sharded weights in one all-reduce.

    Needed only with `fsdp_all_gather`; without it (or without FSDP) this does nothing.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def check_float8_device(
    device_type: str, capability: tuple[int, int] | None = None, *, recipe: str = "tensorwise"
) -> None:
    """Refuse a device without float8 matmuls for `recipe`.

    Refused: CUDA before compute capability 8.9, devices other than CPU and CUDA, and "rowwise" on
    a CPU whose torch has no per-row scales in its CPU `torch._scaled_mm` (torch 2.11).
    """
    if device_type == "cpu":
        if recipe == "rowwise" and not _cpu_scaled_mm_takes_row_scales():
            raise UnsupportedDeviceError(
                f"parallelism: float8 'rowwise' on CPU needs torch._scaled_mm with per-row scales on CPU; torch "
                f"{torch.__version__} supports only per-tensor scales there. Use float8 = 'tensorwise' on CPU, "
                "run rowwise on a CUDA GPU, or use a newer torch (2.15 has it)"
            )
        return
    if device_type != "cuda":
        raise UnsupportedDeviceError(
            f"parallelism: float8 training needs a CPU or a CUDA GPU with float8 matmuls, not {device_type!r}; "
            "remove the float8 setting on this device"
        )
    if capability is None:
        capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise UnsupportedDeviceError(
            f"parallelism: float8 training needs a CUDA GPU of compute capability 8.9 or newer (H100, L4, "
            f"RTX 4090); this one is {capability[0]}.{capability[1]}. Remove the float8 setting here"
        )


@functools.cache
def _cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU float8 matmul accepts one scale per row, as the rowwise recipe uses."""
    a = torch.ones(_FLOAT8_ALIGNMENT, _FLOAT8_ALIGNMENT, dtype=torch.float8_e4m3fn)
    rows, cols = torch.ones(_FLOAT8_ALIGNMENT, 1), torch.ones(1, _FLOAT8_ALIGNMENT)
    try:
        out = torch._scaled_mm(a, a.t(), scale_a=rows, scale_b=cols, out_dtype=torch.float32)
    except RuntimeError:
        return False
    return bool((out == _FLOAT8_ALIGNMENT).all())

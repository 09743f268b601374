"""MXFP8 training through torchao: linear layers whose matmuls run on 32-element blocks scaled by powers of 2.

MXFP8 is the Blackwell (CUDA SM100+) recipe: every matmul operand is cast to float8 in blocks of 32
values along the reduction dim, each block with its own 8-bit power-of-two scale, so no per-tensor
amax has to be reduced. torchao's emulated recipes compute the same casts in PyTorch and multiply
the dequantized values in high precision: MXFP8 numerics on any device, for tests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from titan_parallel.errors import ParallelConfigError, UnsupportedDeviceError, check_choice

logger = logging.getLogger(__name__)

# MXFP8 recipes: torchtitan 0.2.2's names, then torchao 0.18's (_RECIPES below says what each does).
MX_RECIPES = (
    "mxfp8_cublas",
    "mxfp8_cublas_rceil",
    "mxfp8_rceil",
    "mxfp8_rceil_wgrad_with_hp",
    "mxfp8_emulated",
    "mxfp8_emulated_rceil",
)
MX_DIM1_CAST_KERNELS = ("triton", "cuda", "torch")

# One MX scale covers this many consecutive values of a matmul operand.
_MX_BLOCK = 32
_MX_CAPABILITY = (10, 0)  # CUDA SM100 (Blackwell): MX block-scaled matmuls in hardware


@dataclass(frozen=True)
class _Recipe:
    emulated: bool
    scale_rounding: str  # how a block's power-of-two scale is picked from its amax: "floor" or "rceil"
    weight_grad_high_precision: bool = False


# torchtitan 0.2.2's recipe names (torchao 0.13's MXLinearConfig) and torchao 0.18's, on torchao 0.18's
# MXFP8 linear: same element type (float8 e4m3) and block size (32) for every operand.
_RECIPES = {
    "mxfp8_cublas": _Recipe(emulated=False, scale_rounding="floor"),
    "mxfp8_cublas_rceil": _Recipe(emulated=False, scale_rounding="rceil"),
    "mxfp8_rceil": _Recipe(emulated=False, scale_rounding="rceil"),
    "mxfp8_rceil_wgrad_with_hp": _Recipe(
        emulated=False, scale_rounding="rceil", weight_grad_high_precision=True
    ),
    "mxfp8_emulated": _Recipe(emulated=True, scale_rounding="floor"),
    "mxfp8_emulated_rceil": _Recipe(emulated=True, scale_rounding="rceil"),
}
assert tuple(_RECIPES) == MX_RECIPES


def mx_recipe_is_emulated(recipe: str) -> bool:
    """Whether `recipe` runs its matmuls in high precision (any device) rather than MX kernels (SM100+)."""
    return _RECIPES[recipe].emulated


@dataclass(frozen=True)
class MXTraining:
    """MXFP8 linear layers through torchao: torchtitan's `[quantize.linear.mx]` section (`apply_mx` says more)."""

    recipe: str = "mxfp8_cublas"
    dim1_cast_kernel: str = "triton"
    skip_fqns: tuple[str, ...] = ("output",)

    def __post_init__(self) -> None:
        check_choice("mx.recipe", self.recipe, MX_RECIPES)
        check_choice("mx.dim1_cast_kernel", self.dim1_cast_kernel, MX_DIM1_CAST_KERNELS)

    def convert(self, model: nn.Module, device_type: str) -> nn.Module:
        """Make the eligible linear layers of `model` MXFP8 ones, in place, before TP and FSDP."""
        return apply_mx(
            model,
            recipe=self.recipe,
            dim1_cast_kernel=self.dim1_cast_kernel,
            skip_fqns=self.skip_fqns,
            device_type=device_type,
        )


def apply_mx(
    model: nn.Module,
    *,
    recipe: str = "mxfp8_cublas",
    dim1_cast_kernel: str = "triton",
    skip_fqns: Iterable[str] = ("output",),
    device_type: str = "cuda",
) -> nn.Module:
    """Make each eligible `nn.Linear` an MXFP8 linear, in place, before TP and FSDP.

    Linears named in `skip_fqns` (and under them), or whose dims are not multiples of 32, stay in high
    precision. `dim1_cast_kernel` ("triton", "cuda" or "torch") casts the transposed operands of the
    backward; emulated recipes cast everything in PyTorch. The weights stay ordinary parameters, so
    FSDP all-gathers them in their own dtype and each matmul casts what it reads.
    """
    if recipe not in _RECIPES:
        raise ParallelConfigError(
            f"parallelism: mx recipe {recipe!r} is unknown; choose one of {list(_RECIPES)}"
        )
    if dim1_cast_kernel not in MX_DIM1_CAST_KERNELS:
        raise ParallelConfigError(
            f"parallelism: mx dim1_cast_kernel {dim1_cast_kernel!r} is unknown; choose one of "
            f"{list(MX_DIM1_CAST_KERNELS)}"
        )
    chosen = _RECIPES[recipe]
    check_mx_device(device_type, recipe=recipe)
    linear_class = _mx_linear_class()
    from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice, ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    settings = {
        "kernel_preference": KernelPreference.EMULATED if chosen.emulated else KernelPreference.AUTO,
        "scale_calculation_mode": ScaleCalculationMode(chosen.scale_rounding),
        "wgrad_with_hp": chosen.weight_grad_high_precision,
        "dim1_cast_kernel": MXFP8Dim1CastKernelChoice(dim1_cast_kernel),
    }
    skip = tuple(skip_fqns)
    converted = 0
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(fqn == s or fqn.startswith(f"{s}.") for s in skip):
            continue
        if any(d % _MX_BLOCK for d in module.weight.shape):
            continue
        module.__class__ = linear_class  # keeps its parameters, hooks and place in the model
        vars(module).update(settings)
        converted += 1
    logger.info("MX %s: %d linear layers converted (dim1 casts: %s)", recipe, converted, dim1_cast_kernel)
    return model


def missing_mx_matmuls(device_type: str, capability: tuple[int, int] | None = None) -> str | None:
    """None where MXFP8 matmuls run (CUDA compute capability 10.0+), else the device that lacks them, in words."""
    if device_type != "cuda":
        return device_type
    capability = capability or torch.cuda.get_device_capability()
    if capability >= _MX_CAPABILITY:
        return None
    return f"a CUDA GPU of compute capability {capability[0]}.{capability[1]}"


def check_mx_device(device_type: str, capability: tuple[int, int] | None = None, *, recipe: str) -> None:
    """Refuse a device without MX matmuls for a recipe that needs them (all but the emulated ones)."""
    if mx_recipe_is_emulated(recipe):
        return
    missing = missing_mx_matmuls(device_type, capability)
    if missing is not None:
        raise UnsupportedDeviceError(
            f"parallelism: mx recipe {recipe!r} needs MXFP8 matmuls, on a CUDA GPU of compute capability 10.0 "
            f"or newer (B200, GB200), and this run is on {missing}; use an emulated recipe (mxfp8_emulated) to "
            "test, or float8 on this device"
        )


@functools.cache
def _mx_linear_class() -> type[nn.Linear]:
    """torchao's MXFP8 linear, with the dim-1 cast kernel chosen here rather than fixed by torchao."""
    try:
        import torchao.prototype.moe_training.mxfp8_linear as mx_linear
    except ImportError as missing:  # torchao 0.17 has no MXFP8 linear of this shape
        raise UnsupportedDeviceError(
            f"quantize.linear.mx: MXFP8 training needs torchao >= 0.18 (this is torchao "
            f"{_torchao_version()}); upgrade torchao or use quantize.linear.float8"
        ) from missing
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    e4m3 = torch.float8_e4m3fn

    class MXLinear(mx_linear.MXFP8Linear):
        """An MXFP8 linear: inputs, weights and output gradients cast to MXFP8 for all three matmuls."""

        dim1_cast_kernel = None  # set per module by apply_mx

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dim0_cast = (
                MXFP8Dim0CastKernelChoice.TORCH
                if self.kernel_preference == KernelPreference.EMULATED
                else MXFP8Dim0CastKernelChoice.TRITON
            )
            out = mx_linear.mx_mm.apply(
                x,
                self.weight,
                e4m3,
                e4m3,
                e4m3,
                _MX_BLOCK,
                self.kernel_preference,
                dim0_cast,
                self.dim1_cast_kernel,
                self.scale_calculation_mode,
                self.wgrad_with_hp,
            )
            return out if self.bias is None else out + self.bias.to(out.dtype)

    return MXLinear


def _torchao_version() -> str:
    import torchao

    return getattr(torchao, "__version__", "unknown")


def mx_available() -> bool:
    """Whether this torchao has the MXFP8 linear titan-parallel builds on (torchao >= 0.18)."""
    try:
        _mx_linear_class()
    except UnsupportedDeviceError:
        return False
    return True

"""float8 tensor parallelism: a model's plain TP plan, with torchao's float8 styles where they apply.

A model describes its split with torch's plain styles and knows nothing of float8. Once its linear
layers are float8 (tensorwise scaling), the styles that split or feed them are swapped here for
torchao's float8 versions, which cast an activation to float8 before its all-gather: the TP
collectives then move half the bytes of bfloat16. Rowwise float8 keeps the plain styles (torchao
all-gathers float8 only with one scale per tensor), and so does every module that is not a float8
linear: the embedding, the output head left in high precision, the norms.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from titan_parallel.tensor_parallel import resolve_plan


def float8_tp_plan(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan`, resolved to module names, with float8 styles for the float8 linears and their inputs.

    `ColwiseParallel` / `RowwiseParallel` on a torchao `Float8Linear` become `Float8ColwiseParallel` /
    `Float8RowwiseParallel`; `PrepareModuleInput` on a module whose linears are all float8 becomes
    `PrepareFloat8ModuleInput`, so an input read by several linears (wq, wk, wv) is cast and gathered
    once. Layouts are kept as the model gave them. Subclasses of the plain styles are left alone:
    they may do more than split. Call after `apply_float8` (tensorwise), before `apply_tp`.
    """
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    _gather_cpu_float8_as_bytes()

    def all_linears_float8(module: nn.Module) -> bool:
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        return bool(linears) and all(isinstance(m, Float8Linear) for m in linears)

    swapped: dict[str, ParallelStyle] = {}
    for name, style in resolve_plan(model, plan).items():
        module = model.get_submodule(name)
        float8_style: ParallelStyle | None = None
        if type(style) is ColwiseParallel and isinstance(module, Float8Linear):
            float8_style = Float8ColwiseParallel()
        elif type(style) is RowwiseParallel and isinstance(module, Float8Linear):
            float8_style = Float8RowwiseParallel()
        elif type(style) is PrepareModuleInput and all_linears_float8(module):
            float8_style = PrepareFloat8ModuleInput()
        if float8_style is not None:
            # The float8 styles add state of their own but keep the plain style's layout attributes.
            vars(float8_style).update(vars(style))
        swapped[name] = float8_style or style
    return swapped


@functools.cache
def _gather_cpu_float8_as_bytes() -> None:
    """Let torchao's float8 all-gather run on gloo, which has no float8 dtypes ("Invalid scalar type").

    torchao gathers a float8 tensor's data with the functional all-gather; for CPU tensors this sends
    the same bytes as uint8 and reads them back as float8, so CPU runs test the float8 TP path itself.
    CUDA tensors (NCCL has float8) take torchao's own path.
    """
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    for op in (
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    ):
        torchao_gather = float8_ops.FLOAT8_OPS_TABLE[op]

        def gather(aten_op, args, kwargs=None, torchao_gather=torchao_gather):
            fp8 = args[0]
            if fp8._data.device.type != "cpu":
                return torchao_gather(aten_op, args, kwargs)
            data = fp8._data.contiguous()
            # A view of the gathered buffer: waiting on it waits on the collective (same storage).
            gathered = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})).view(data.dtype)
            return Float8TrainingTensor(
                gathered, fp8._scale, fp8._orig_dtype, fp8._linear_mm_config, fp8._gemm_input_role
            )

        float8_ops.FLOAT8_OPS_TABLE[op] = gather

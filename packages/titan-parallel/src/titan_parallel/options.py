"""The settings `parallelize` and `build_pipeline` take: one group per concern, checked when built.

Each group lives beside the transform it configures and checks its own fields; a group with a
step of its own applies itself (`ActivationCheckpointing.apply`, `Float8Training.convert`,
`Compile.apply`, ...). `ParallelOptions` holds them and checks only what spans two groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_parallel.activation_checkpoint import ActivationCheckpointing
from titan_parallel.compile import Compile
from titan_parallel.context_parallel import ContextParallelOptions
from titan_parallel.errors import ParallelConfigError
from titan_parallel.float8 import Float8Training
from titan_parallel.fsdp import DataParallelOptions
from titan_parallel.lora import LoRA
from titan_parallel.mx import MXTraining
from titan_parallel.pipeline_options import PipelineOptions
from titan_parallel.tensor_parallel import TensorParallelOptions


@dataclass(frozen=True)
class ParallelOptions:
    """Everything about a layout other than its degrees (those are `ParallelDims`).

    The groups follow torchtitan's config sections, so a trainer maps each section onto its group one
    to one. `float8` and `mx` are None when the linear layers stay in high precision; `lora` is None when
    the whole model trains.
    """

    data_parallel: DataParallelOptions = field(default_factory=DataParallelOptions)
    tensor_parallel: TensorParallelOptions = field(default_factory=TensorParallelOptions)
    activation_checkpoint: ActivationCheckpointing = field(default_factory=ActivationCheckpointing)
    compile: Compile = field(default_factory=Compile)
    float8: Float8Training | None = None
    mx: MXTraining | None = None
    lora: LoRA | None = None
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    context_parallel: ContextParallelOptions = field(default_factory=ContextParallelOptions)

    def __post_init__(self) -> None:
        for name, group in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, group) and not (value is None and name in _OPTIONAL):
                raise ParallelConfigError(
                    f"parallelism: ParallelOptions.{name} takes a {group.__name__}"
                    f"{' or None' if name in _OPTIONAL else ''}, got {value!r}"
                )
        if self.float8 is not None and self.mx is not None:
            raise ParallelConfigError(
                f"parallelism: float8 ({self.float8.recipe!r}) and mx ({self.mx.recipe!r}) both convert the "
                "linear layers; choose one"
            )


_GROUPS = {
    "data_parallel": DataParallelOptions,
    "tensor_parallel": TensorParallelOptions,
    "activation_checkpoint": ActivationCheckpointing,
    "compile": Compile,
    "float8": Float8Training,
    "mx": MXTraining,
    "lora": LoRA,
    "pipeline": PipelineOptions,
    "context_parallel": ContextParallelOptions,
}
_OPTIONAL = ("float8", "mx", "lora")  # None: the linear layers stay in high precision; no adapters

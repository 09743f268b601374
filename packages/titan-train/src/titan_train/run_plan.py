"""What a run is, as the resolve step (`titan_train.plan.resolve`) decided it: the `RunPlan` every consumer
reads. Data only: the builders in `titan_train.wiring` take it, and the resolve step, which stands above
them, makes it, so neither imports the other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from titan_parallel import ParallelDims, ParallelOptions, blocks_of
from titan_train.config.schema import JobConfig
from titan_train.config.sft_section import is_chat
from titan_train.registry import LossFn, ModelFamily


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model split into what pipeline stages hold."""

    total: int
    embedding: int
    per_block: int
    n_blocks: int

    @classmethod
    def of(cls, model: nn.Module, family: ModelFamily) -> ParamCounts:
        """Counts read from a (meta-device) model: the family's totals and the size of its blocks."""
        total, embedding = family.count_parameters(model)
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks_of(model).values()]
        return cls(total=total, embedding=embedding, per_block=max(sizes, default=0), n_blocks=len(sizes))


@dataclass(frozen=True)
class RunPlan:
    """What a run is. `dims` is the layout's degrees (its mesh is built by whoever runs the layout)."""

    config: JobConfig
    world_size: int
    device_type: str  # the device the run computes on, which picks its dtypes ("cuda" for a dry run)
    family: ModelFamily
    model_args: Any  # the family's args, with max_seq_len = seq_len (eos_id set by the builder)
    seq_len: int  # positions the model is built for: the longer of training's and validation's
    dims: ParallelDims
    grad_accum_steps: int
    loss_fn: LossFn  # the configured loss (compiled or chunked), unscaled: validation's
    options: ParallelOptions
    params: ParamCounts
    # Data streams the training data is dealt into (0: one per data-parallel rank). A resumed run whose
    # setting is 0 adopts the saved number: the trainer replaces its plan (`with_streams`), never the config.
    num_streams: int = 0
    # Optimizer steps the run trains to: training.steps, or what training.epochs passes over the data take,
    # which only the data can tell (the trainer counts them: `with_steps`); the config keeps what was given.
    steps: int = 0
    # The training objective's registered name, decided once by titan_train.objectives.registry.objective_name.
    objective: str = "next_token"

    @property
    def seed(self) -> int:
        """The seed of the initial weights and of torch's generator (`debug.seed`, 0 when unset)."""
        return 0 if self.config.debug.seed is None else self.config.debug.seed

    @property
    def losses_per_step(self) -> int:
        """The losses one optimizer step backpropagates, each scaled by the inverse of their number:
        gradient-accumulation steps, times a pipeline schedule's microbatches."""
        t = self.config.training
        microbatches = self.options.pipeline.microbatches(t.local_batch_size) if self.dims.pp > 1 else 1
        return self.grad_accum_steps * microbatches

    @property
    def is_chat(self) -> bool:
        """Whether training reads chat rows (`titan_train.config.sft_section.is_chat`)."""
        return is_chat(self.config.training)

    def with_streams(self, num_streams: int) -> RunPlan:
        """This plan with the training data dealt into `num_streams` streams (a resumed position's)."""
        return replace(self, num_streams=num_streams)

    def with_steps(self, steps: int) -> RunPlan:
        """This plan training `steps` optimizer steps (training.epochs counted over the data)."""
        return replace(self, steps=steps)

    @property
    def train_seq_len(self) -> int:
        """Tokens per training sequence (FLOPs and memory count these)."""
        return self.config.training.seq_len

    @property
    def tokens_per_step(self) -> int:
        t = self.config.training
        return t.local_batch_size * t.seq_len * self.dims.dp_degree * self.grad_accum_steps

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, as the family counts them."""
        p = self.params
        return self.family.flops_per_token(self.model_args, p.total, p.embedding, self.train_seq_len)

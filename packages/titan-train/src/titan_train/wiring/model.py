"""The model a plan describes, as this rank holds it: built, parallelised, initialised."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from titan_data import Tokenizer
from titan_parallel import Pipeline, init_lora
from titan_train.errors import ConfigError
from titan_train.registry import LossFn
from titan_train.run_plan import RunPlan
from titan_train.wiring.loss import micro_batch_loss
from titan_train.wiring.moe import has_experts
from titan_train.wiring.parallelism import split_and_wrap
from titan_train.wiring.precision import cast_parameters, dtype_of
from titan_train.wiring.valid_token_loss import ValidTokenWeights


@dataclass
class BuiltModel:
    """The model as this rank holds it: its parts, the pipeline schedule (pp > 1), the args it was built
    from, and `train_loss_fn`, the loss each micro-batch backpropagates (the plan's loss scaled for
    gradient accumulation by `micro_batch_loss`; the pipeline's too). Chat rows, which mask a different
    share of each row, also weight it by its trained tokens: `token_weights`, set before each step."""

    args: Any
    parts: list[nn.Module]
    pipeline: Pipeline | None
    train_loss_fn: LossFn
    token_weights: ValidTokenWeights | None = None


def check_vocabulary(plan: RunPlan, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer with more tokens than the model's vocabulary (its ids would index past it)."""
    vocab_size = plan.model_args.vocab_size
    if tokenizer.vocab_size > vocab_size:
        m = plan.config.model
        raise ConfigError(
            f"config: the tokenizer has {tokenizer.vocab_size} tokens but {m.name} {m.flavor} has a "
            f"vocabulary of {vocab_size}; use a matching model.flavor or model.hf_assets_path"
        )


def build_model(
    plan: RunPlan,
    device: torch.device,
    *,
    eos_id: int | None,
    seed: int,
    drill: Callable[[LossFn], LossFn] | None = None,
    n_layers: int | None = None,
    materialize: bool = True,
    args: Any = None,
) -> BuiltModel:
    """The plan's model on the meta device, parallelised (or cut into pipeline stages), then
    materialised on `device` and initialised: the initial weights are the same for every layout. The
    one builder of a model, for training, the memory trace, generation and evaluation alike (these two
    with `titan_train.plan.one_process_plan`), and for a second copy of a run's model (call it again with
    the same plan and seed: the same initial weights). `eos_id` is the tokenizer's (documents end there);
    `drill` wraps the training loss for a `[health] drill = nan` (see `FaultDrills.loss_with_drill`).

    A memory trace builds it with fewer blocks (`n_layers`), and without `materialize` leaves it on
    the meta device, to be moved onto fake tensors under torch's `FakeTensorMode`. `args` replaces the
    plan's model args (a checkpoint folder's shape, a longer rotary table)."""
    config = plan.config
    overrides = {"eos_id": eos_id} if n_layers is None else {"eos_id": eos_id, "n_layers": n_layers}
    args = replace(plan.model_args if args is None else args, **overrides)
    if has_experts(args):
        # Each of the step's losses is scaled by 1 / their number: the sequence-wise aux loss too.
        args = replace(args, moe_args=replace(args.moe_args, aux_loss_scale=1.0 / plan.losses_per_step))
    with torch.device("meta"):
        model = plan.family.build(args)
    if config.training.dtype != "float32":
        cast_parameters(model, dtype_of(config.training.dtype))
    token_weights = ValidTokenWeights() if plan.is_chat else None
    loss_fn = token_weights.wrap(plan.loss_fn) if token_weights is not None else plan.loss_fn
    train_loss_fn = micro_batch_loss(loss_fn, plan.grad_accum_steps)
    if drill is not None:
        train_loss_fn = drill(train_loss_fn)
    wrapped = split_and_wrap(
        model,
        plan.dims,
        plan.options,
        loss_fn=train_loss_fn,
        eval_loss_fn=plan.loss_fn,
        device=device,
        local_batch_size=config.training.local_batch_size,
    )
    for part in wrapped.parts:
        if materialize:
            part.to_empty(device=device)
            part.init_weights(buffer_device=device, seed=seed)
            if plan.options.lora is not None:
                init_lora(part, seed)
        part.train()
    return BuiltModel(args, wrapped.parts, wrapped.pipeline, train_loss_fn, token_weights)

"""The run's loss: the family's, compiled or chunked as configured, and scaled per micro-batch."""

from __future__ import annotations

import torch

from titan_train.config.schema import JobConfig
from titan_train.registry import LossFn, ModelFamily, cross_entropy_loss
from titan_train.wiring.chunked_loss import chunked_cross_entropy


def micro_batch_loss(loss_fn: LossFn, grad_accum_steps: int) -> LossFn:
    """The loss one of `grad_accum_steps` micro-batches backpropagates: 1/N of `loss_fn`'s, so the step's
    gradients add up to those of the whole batch's mean. The one place training scales its loss, for
    the plain step and the pipeline alike."""

    def scaled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, labels) / grad_accum_steps

    return scaled


def build_loss_fn(config: JobConfig, family: ModelFamily) -> LossFn:
    """The model's loss, compiled when `[compile] components` names "loss", else chunked over tokens
    (`training.chunked_loss`, see `chunked_loss`) where it is the plain cross-entropy.

    Compiled, the float32 upcast, log-softmax and gather over the vocabulary fuse into a few kernels
    that never hold the float32 logits: at seq 8192 and a 128K vocabulary, 4 GiB less per sequence
    (measured on an H100 in bench/RESULTS.md).
    """
    c = config.compile  # its components and backend were checked at start (validate_config)
    if c.enable and "loss" in c.components:
        return torch.compile(family.loss_fn, backend=c.backend)
    if config.training.chunked_loss and family.loss_fn is cross_entropy_loss:
        return chunked_cross_entropy
    return family.loss_fn

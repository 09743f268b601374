"""One optimizer and one LR schedule per model part, stepped together.

Pipeline parallelism gives a rank several model parts (stages); DCP's optimizer state dict is per
(module, optimizer) pair and names state by parameter FQN, which a part keeps from the whole model,
so one optimizer per part keeps checkpoints portable across pipeline layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LRScheduler
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from titan_parallel import ModelDescriptionError, Muon, muon_param_groups
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.wiring.lr_schedule import build_lr_scheduler


class PartOptimizers:
    """The optimizers of every model part, and their (identical) LR schedules."""

    def __init__(
        self,
        parts: list[nn.Module],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        make_schedule: Callable[[torch.optim.Optimizer], LRScheduler],
    ):
        self.optimizers = [make_optimizer(part) for part in parts]
        self.schedules = [make_schedule(optimizer) for optimizer in self.optimizers]

    @property
    def lr(self) -> float:
        """The learning rate the next `step()` uses."""
        return self.optimizers[0].param_groups[0]["lr"]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        """An optimizer step of every part, then one step of the LR schedules."""
        for optimizer in self.optimizers:
            optimizer.step()
        for schedule in self.schedules:
            schedule.step()

    def step_unless(self, skip: torch.Tensor, allowed: Callable[[], bool]) -> bool:
        """Step unless the step must be skipped; return whether it stepped.

        `skip` is a device flag and `allowed()` the host's verdict on the same numbers, which waits for
        them. Fused Adam/AdamW take `skip` as `found_inf` and leave parameters, moments and step counts
        untouched where it is 1, so their update is queued before the host waits: the device runs it
        while the host reads the verdict and queues the next step, instead of idling at a sync. Other
        optimizers wait for the verdict first. The LR schedules step only after an update.
        """
        if not all(group.get("fused") for opt in self.optimizers for group in opt.param_groups):
            if allowed():
                self.step()
                return True
            return False
        for optimizer in self.optimizers:
            optimizer.found_inf = skip.to(torch.float32)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        if not allowed():
            return False
        for schedule in self.schedules:
            schedule.step()
        return True

    def schedule_state(self) -> Stateful:
        return SchedulesState(self.schedules)


class SchedulesState(Stateful):
    """Checkpoint view of the schedules: saved once, restored into every part's schedule.

    What is restored is the position (steps taken); the learning rate of the next step is then
    computed from this run's schedule, not taken from the checkpoint, so a run extended to more steps
    (or resumed with another schedule) follows its own schedule from where it stands. Unchanged, it
    is the saved value to the bit: the same product the schedule's step computed.
    """

    # Kept by some torch versions only (torchtitan's checkpoints written under torch 2.11 lack them);
    # a LambdaLR's lambdas are code, never restored from a checkpoint.
    optional_keys = ("lr_lambdas", "_is_initial", "_get_lr_called_within_step")

    def __init__(self, schedules: list[LRScheduler]):
        self.schedules = schedules

    def state_dict(self) -> dict[str, Any]:
        return self.schedules[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for schedule in self.schedules:
            schedule.load_state_dict(
                {"lr_lambdas": [None] * len(schedule.optimizer.param_groups), **state_dict}
            )
            rates = schedule.get_lr()
            for group, lr in zip(schedule.optimizer.param_groups, rates, strict=True):
                group["lr"] = lr
            schedule._last_lr = list(rates)


def build_optimizer(config: JobConfig, model: nn.Module | list[nn.Parameter]) -> torch.optim.Optimizer:
    """The configured optimizer over a model part's trainable parameters (or a list of them): a frozen
    parameter (the base of a LoRA run) gets no optimizer state."""
    o = config.optimizer
    if o.name == "Muon":
        return build_muon(config, model)
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[o.name]
    impl = o.implementation
    kwargs = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    kwargs["fused"] = impl == "fused"  # CUDA and CPU both have fused Adam kernels
    kwargs["foreach"] = impl == "foreach"
    params = list(model.parameters()) if isinstance(model, nn.Module) else model
    params = [p for p in params if p.requires_grad]
    if impl == "fused":
        _check_fused_kernel(o.name, {p.device.type for p in params})
    return cls(params, **kwargs)


def build_muon(config: JobConfig, model: nn.Module | list[nn.Parameter]) -> Muon:
    """Muon on the model part's hidden matrices (as the model names them), AdamW on the rest, in one
    optimizer whose state DCP saves and reshards as it does AdamW's. The AdamW group runs torch's
    single-tensor AdamW (`optimizer.implementation` does not apply to it)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            "build_muon takes a whole model part (Muon with a step in backward is refused at start)"
        )
    o, m = config.optimizer, config.optimizer.muon
    muon = {
        "lr": o.lr if m.lr is None else m.lr,
        "weight_decay": o.weight_decay if m.weight_decay is None else m.weight_decay,
        "momentum": m.momentum,
        "nesterov": m.nesterov,
        "ns_coefficients": tuple(m.ns_coefficients),
        "ns_steps": m.ns_steps,
        "ns_dtype": m.ns_dtype,
        "eps": m.eps,
        "adjust_lr_fn": m.adjust_lr_fn,
    }
    adamw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    try:
        return Muon(muon_param_groups(model, muon, adamw))
    except ModelDescriptionError as err:
        raise ConfigError(f"config: optimizer.name = 'Muon': {err}") from err


def _check_fused_kernel(name: str, device_types: set[str]) -> None:
    """Refuse `implementation = "fused"` where torch has no fused kernel, rather than let the first
    step fail or fall back to another implementation without a word."""
    supported = _get_fused_kernels_supported_devices()
    missing = sorted(device_types - set(supported))
    if missing:
        raise ConfigError(
            f"config: optimizer.implementation = 'fused': torch has no fused {name} kernel on {', '.join(missing)} "
            f"(it has one on {', '.join(supported)}); set optimizer.implementation = 'foreach' or 'for-loop'"
        )


def build_lr_schedule(config: JobConfig, optimizer: torch.optim.Optimizer, steps: int):
    """The `[lr_scheduler]` schedule of a run training `steps` steps (`RunPlan.steps`), over
    `lr_scheduler.total_steps` where that is set."""
    s = config.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        total_steps=s.total_steps or steps,
        warmup_steps=s.warmup_steps,
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )

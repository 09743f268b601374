"""Semi-synchronous training across replica groups: torchft's LocalSGD and (Streaming) DiLoCo.

Both hook the inner optimizer: every step is local to the group, and after every `sync_steps` optimizer
steps the groups meet. LocalSGD averages the parameters. DiLoCo averages each fragment's pseudo-gradient
(the weights at the last sync minus the weights now) and an outer optimizer (Nesterov SGD, lr 0.7, momentum
0.9: torchtitan 0.2.2's choice) steps from the last sync's weights with it; with several fragments, one
fragment syncs every `sync_steps / fragments` steps, its all-reduce `fragment_sync_delay` steps before it is
applied, and `fragment_update_alpha` mixes the local weights into the result.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.optim import Optimizer

from titan_train.config.fault_tolerance_section import fragment_count

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def model_fragments(model: nn.Module, settings) -> list[nn.Module]:
    """The model split into the fragments DiLoCo syncs in turn: the named modules of each, or `num_fragments`
    even runs of `units` (the model's top-level modules in forward order). Every parameter lies in exactly
    one fragment; a split that breaks that was refused at start (`fragment_problems`)."""
    fragments, problem = _split(model, settings)
    if problem:
        raise ValueError(problem)
    return fragments


def fragment_problems(config, model: nn.Module) -> list[str]:
    """The DiLoCo split a run's config asks of `model` (its meta-device build will do), for the plan's check."""
    ft = config.fault_tolerance
    if not (ft.enable and ft.semi_sync_method == "diloco"):
        return []
    return [problem] if (problem := _split(model, ft)[1]) else []


def _split(model: nn.Module, settings) -> tuple[list[nn.Module], str | None]:
    names = settings.module_fqns_per_model_fragment
    units = model.pipeline_units()
    if not names:
        n = fragment_count(settings)
        if n > len(units):
            return [], (
                f"config: fault_tolerance.num_fragments ({n}) is more than the model's {len(units)} top-level "
                f"modules ({', '.join(units)}); use at most {len(units)} or name the fragments' modules"
            )
        cuts = [i * len(units) // n for i in range(n + 1)]
        names = [units[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    modules = dict(model.named_modules())
    fragments = []
    for group in names:
        missing = [name for name in group if name not in modules]
        if missing:
            return [], (
                f"config: fault_tolerance.module_fqns_per_model_fragment names {missing[0]!r}, which is not a "
                f"module of the model (its top-level modules: {', '.join(units)})"
            )
        fragments.append(nn.ModuleList([modules[name] for name in group]))
    owners: dict[int, int] = {}
    for i, fragment in enumerate(fragments):
        for p in fragment.parameters():
            if owners.setdefault(id(p), i) != i:
                return (
                    [],
                    "config: fault_tolerance.module_fqns_per_model_fragment puts a parameter in two fragments",
                )
    left = [name for name, p in model.named_parameters() if id(p) not in owners]
    if left:
        return [], (
            f"config: fault_tolerance.module_fqns_per_model_fragment leaves {left[0]} (and {len(left) - 1} more) "
            "in no fragment, so it would never sync; name every top-level module in one fragment"
        )
    return fragments, None


def semi_sync_training(manager, settings, parts: list[nn.Module], optimizers: list[Optimizer]):
    """The context in which the inner optimizer's steps sync the groups (nothing for synchronous training)."""
    method = settings.semi_sync_method
    if method is None:
        return contextlib.nullcontext()
    assert len(parts) == 1, "semi-synchronous training under pipeline parallelism is refused at start"
    from torchft import local_sgd

    model, optimizer = parts[0], optimizers[0]
    if method == "local_sgd":
        return local_sgd.LocalSGD(
            manager=manager, model=model, optimizer=optimizer, sync_every=settings.sync_steps
        )
    fragments = model_fragments(model, settings)
    outer = [
        torch.optim.SGD(
            [p for p in fragment.parameters() if p.requires_grad],
            lr=OUTER_LR,
            momentum=OUTER_MOMENTUM,
            nesterov=True,
        )
        for fragment in fragments
    ]
    return local_sgd.DiLoCo(
        manager=manager,
        model_fragments=fragments,
        inner_optimizer=optimizer,
        outer_optimizer=outer,
        sync_every=settings.sync_steps,
        pin_memory=torch.cuda.is_available(),  # pinned host memory needs a GPU driver
        should_quantize=settings.should_quantize,
        fragment_sync_delay=settings.fragment_sync_delay,
        fragment_update_alpha=settings.fragment_update_alpha,
    )

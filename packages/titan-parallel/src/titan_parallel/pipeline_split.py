"""Cutting a model into pipeline stages: which units each stage keeps, and the pruned stage modules."""

from __future__ import annotations

import copy

from torch import nn

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError
from titan_parallel.protocols import HasPipelineUnits


def pipeline_units_of(model: nn.Module) -> list[str]:
    """The units a model declares through `pipeline_units()`, with a clear error if it has none."""
    if not isinstance(model, HasPipelineUnits):
        raise ModelDescriptionError(
            f"{type(model).__name__} cannot be pipelined: give it a pipeline_units() method returning its "
            'top-level module names in forward order, e.g. ["tok_embeddings", "layers.0", ..., "output"]'
        )
    return model.pipeline_units()


def split_units(
    units: list[str],
    blocks: list[str],
    num_stages: int,
    *,
    layers_per_stage: int | None = None,
    split_points: tuple[str, ...] | list[str] = (),
) -> list[list[str]]:
    """Assign contiguous runs of `units` to `num_stages` stages.

    With `split_points`, a new stage begins at each named unit. Otherwise the blocks are spread
    evenly (or `layers_per_stage` each), the units before the first block join the first stage
    and every other non-block unit joins the stage of the block before it.
    """
    if split_points:
        return _split_at(units, list(split_points), num_stages)
    block_set = set(blocks)
    ordered_blocks = [u for u in units if u in block_set]
    n = len(ordered_blocks)
    if layers_per_stage is not None:
        if layers_per_stage * num_stages != n:
            raise ParallelConfigError(
                f"parallelism: pp_layers_per_stage ({layers_per_stage}) * {num_stages} stages = "
                f"{layers_per_stage * num_stages}, but the model has {n} layers; choose a divisor of {n}"
            )
    if num_stages > n:
        raise ParallelConfigError(
            f"parallelism: {num_stages} pipeline stages but the model has only {n} layers; every stage needs "
            "at least one, so lower pp or use a single-stage schedule (1F1B, GPipe)"
        )
    sizes = _even_sizes(n, num_stages)
    stage_of_block, b = {}, 0
    for stage, size in enumerate(sizes):
        for name in ordered_blocks[b : b + size]:
            stage_of_block[name] = stage
        b += size
    stages: list[list[str]] = [[] for _ in range(num_stages)]
    current = 0
    for unit in units:
        current = stage_of_block.get(unit, current)
        stages[current].append(unit)
    return stages


def _even_sizes(n: int, parts: int) -> list[int]:
    # The first stage also runs the embedding and the last the output head and loss (the heavier of
    # the two), so the extra blocks of an uneven split go to the middle stages, then the first.
    sizes = [n // parts] * parts
    order = [*range(1, parts - 1), 0, parts - 1]
    for i in order[: n % parts]:
        sizes[i] += 1
    return sizes


def _split_at(units: list[str], points: list[str], num_stages: int) -> list[list[str]]:
    unknown = [p for p in points if p not in units]
    if unknown:
        raise ParallelConfigError(
            f"parallelism: pp_split_points {unknown} are not pipeline units of the model; choose among {units}"
        )
    positions = [units.index(p) for p in points]
    if positions != sorted(set(positions)) or positions[0] == 0:
        raise ParallelConfigError(
            f"parallelism: pp_split_points {points} must be distinct units in forward order, after the first "
            f"unit '{units[0]}'"
        )
    if len(points) + 1 != num_stages:
        raise ParallelConfigError(
            f"parallelism: {len(points)} pp_split_points make {len(points) + 1} stages, but the schedule needs "
            f"{num_stages} (pp * stages per rank); give {num_stages - 1} split points"
        )
    bounds = [0, *positions, len(units)]
    return [units[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_module(model: nn.Module, keep: list[str], units: list[str]) -> nn.Module:
    """A deep copy of `model` holding only the units in `keep`; the others are removed.

    Call it on a model built on the meta device: the copy is then free.
    """
    stage = copy.deepcopy(model)
    dropped = [u for u in units if u not in set(keep)]
    # Reverse order so deleting from a ModuleList does not shift indices still to be deleted.
    for unit in reversed(dropped):
        parent_name, _, child = unit.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        elif isinstance(parent, nn.ModuleList):
            del parent[int(child)]
        else:
            setattr(parent, child, None)
    return stage

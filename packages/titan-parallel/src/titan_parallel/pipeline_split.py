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
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
    split_points: tuple[str, ...] | list[str] = (),
) -> list[list[str]]:
    """Assign contiguous runs of `units` to `num_stages` stages, as torchtitan cuts them.

    With `split_points`, a new stage begins at each named unit. Otherwise the units before the first
    block (the embedding) count as `first_stage_less_layers` layers and those after the last block
    (norm and output head) as `last_stage_less_layers`; these weighted layers are spread evenly over
    the stages, the first stages taking one more when they do not divide. So the same settings give
    the same stages, with the same module names, as torchtitan; a stage may hold no block at all.
    """
    if split_points:
        return _split_at(units, list(split_points), num_stages)
    block_set = set(blocks)
    ordered_blocks = [u for u in units if u in block_set]
    if num_stages == 1:
        return [list(units)]
    n, first, last = len(ordered_blocks), first_stage_less_layers, last_stage_less_layers
    effective = n + first + last
    if num_stages > effective:
        raise ParallelConfigError(
            f"parallelism: {num_stages} pipeline stages but the model has only {effective} layers counting the "
            f"embedding as {first} and the output as {last} (pipeline_parallel_first/last_stage_less_layers); "
            "lower pp or the stages per rank"
        )
    per_stage, extra = divmod(effective, num_stages)
    for name, weight in (("first", first), ("last", last)):
        if weight > per_stage:
            raise ParallelConfigError(
                f"parallelism: pipeline_parallel_{name}_stage_less_layers ({weight}) exceeds the {per_stage} "
                f"layers each of {num_stages} stages gets ({n} layers + {first} + {last}); lower it"
            )
    sizes = [per_stage + (stage < extra) for stage in range(num_stages)]
    sizes[0] -= first
    sizes[-1] -= last
    stage_of_block, b = {}, 0
    for stage, size in enumerate(sizes):
        for name in ordered_blocks[b : b + size]:
            stage_of_block[name] = stage
        b += size
    after_last = units.index(ordered_blocks[-1]) + 1 if ordered_blocks else len(units)
    stages: list[list[str]] = [[] for _ in range(num_stages)]
    current = 0
    for i, unit in enumerate(units):
        # Units before the first block stay on the first stage, those after the last go to the last.
        current = num_stages - 1 if i >= after_last else stage_of_block.get(unit, current)
        stages[current].append(unit)
    return stages


def _split_at(units: list[str], points: list[str], num_stages: int) -> list[list[str]]:
    unknown = [p for p in points if p not in units]
    if unknown:
        raise ParallelConfigError(
            f"parallelism: pipeline.split_points {unknown} are not pipeline units of the model; choose among {units}"
        )
    positions = [units.index(p) for p in points]
    if positions != sorted(set(positions)) or positions[0] == 0:
        raise ParallelConfigError(
            f"parallelism: pipeline.split_points {points} must be distinct units in forward order, after the first "
            f"unit '{units[0]}'"
        )
    if len(points) + 1 != num_stages:
        raise ParallelConfigError(
            f"parallelism: {len(points)} pipeline.split_points make {len(points) + 1} stages, but the schedule needs "
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

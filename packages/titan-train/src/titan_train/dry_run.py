"""A dry run: check a config and its layout for N GPUs on any machine, and estimate memory per rank.

torch's fake process-group backend lets one CPU process build the real device mesh of a 512-rank job
(it answers every collective without communicating), and the model is built on the meta device, so
nothing is allocated. What this cannot check is the GPUs themselves: kernels, bandwidth, actual memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_models import count_parameters
from titan_parallel import ParallelConfigError, ParallelDims, blocks_of, pipeline_stages
from titan_train import build
from titan_train.errors import ConfigError
from titan_train.hf_interop import model_args
from titan_train.memory_estimate import MemoryEstimate, ParamCounts, estimate_memory_per_rank
from titan_train.parallelism import parallel_options
from titan_train.registry import get_model_spec
from titan_train.sequence_limit import model_seq_len
from titan_train.unsupported import UnsupportedConfigError, refuse_unsupported

logger = logging.getLogger(__name__)


@dataclass
class DryRunReport:
    world_size: int
    degrees: dict[str, int]
    mesh: str
    params: ParamCounts
    grad_accum_steps: int
    tokens_per_step: int
    memory: MemoryEstimate
    notes: list[str] = field(default_factory=list)

    def lines(self, config: Any) -> list[str]:
        t = config.training
        gib = 2**30
        out = [
            f"dry run: {config.model.name} {config.model.flavor} on {self.world_size} ranks "
            "(fake process group: the layout is built, nothing is computed)",
            f"  mesh: {self.mesh}",
            f"  parameters: {self.params.total:,} ({self.params.embedding:,} in the embedding, "
            f"{self.params.n_blocks} blocks of {self.params.per_block:,})",
            f"  batch: {t.local_batch_size} sequence{'s' if t.local_batch_size != 1 else ''} of {t.seq_len} tokens per data-parallel rank, "
            f"gradient accumulation {self.grad_accum_steps}: {self.tokens_per_step:,} tokens per step",
            f"  memory per rank (estimate; activation checkpointing '{config.activation_checkpoint.mode}'):",
        ]
        out += [f"    {name:<40}{size / gib:>9.2f} GiB" for name, size in self.memory.rows()]
        out += [f"  note: {note}" for note in self.notes]
        return out


def layout_problems(config: Any, dims: ParallelDims, args: Any) -> list[str]:
    """Everything wrong with this layout for this model, so a user fixes them all in one go."""
    t = config.training
    problems = []
    try:
        dims.check_model(
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            n_kv_heads=args.kv_heads,
            seq_len=t.seq_len,
            vocab_size=args.vocab_size,
        )
        if dims.pp > 1:  # the stages build_pipeline would cut, checked without building them
            blocks = [f"layers.{i}" for i in range(args.n_layers)]
            options = parallel_options(config, torch.float32, torch.float32)
            pipeline_stages(["tok_embeddings", *blocks, "norm", "output"], blocks, dims.pp, options)
    except (ParallelConfigError, ConfigError) as err:
        problems.append(str(err))
    try:
        build.gradient_accumulation_steps(config, dims.dp_degree)
    except ConfigError as err:
        problems.append(str(err))
    return problems


def _notes(config: Any) -> list[str]:
    notes = []
    try:
        refuse_unsupported(config, "cuda")
    except UnsupportedConfigError as err:
        notes.append(f"training itself would stop here: {err}")
    assets = config.model.hf_assets_path
    if assets and not Path(assets).exists():
        notes.append(f"model.hf_assets_path {assets} does not exist here; training needs the tokenizer there")
    return notes


def _fake_world(world_size: int) -> None:
    if dist.is_initialized():
        raise RuntimeError("a dry run builds its own (fake) process group: run it in a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _describe_mesh(dims: ParallelDims) -> str:
    mesh = dims.mesh
    shape = ", ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    views = [name for name in ("dp", "dp_shard_cp", "dp_cp") if dims.submesh(name) is not None]
    flat = f"; flattened views: {', '.join(f'{v}={dims.submesh(v).size()}' for v in views)}" if views else ""
    return f"({shape}){flat}"


def dry_run(config: Any, world_size: int) -> DryRunReport:
    """Validate `config` for `world_size` ranks, build its mesh and meta model, and log the layout and memory."""
    dims = build.build_parallel_dims(config, world_size)
    spec = get_model_spec(config.model.name)
    args = model_args(config, max_seq_len=model_seq_len(config))
    problems = layout_problems(config, dims, args)
    if problems:
        raise ConfigError("dry run: the layout does not work:\n  - " + "\n  - ".join(problems))

    with torch.device("meta"):
        model = spec.build(args)
    n_embedding = count_parameters(model) - count_parameters(model, exclude_embedding=True)
    counts = ParamCounts.of(model, blocks_of(model), n_embedding)

    _fake_world(world_size)
    try:
        dims.build_mesh("cpu")
        mesh = _describe_mesh(dims)
    finally:
        dist.destroy_process_group()

    accum = build.gradient_accumulation_steps(config, dims.dp_degree)
    t = config.training
    report = DryRunReport(
        world_size=world_size,
        degrees=dims.degrees,
        mesh=mesh,
        params=counts,
        grad_accum_steps=accum,
        tokens_per_step=t.local_batch_size * t.seq_len * dims.dp_degree * accum,
        memory=estimate_memory_per_rank(config, args, dims.degrees, counts),
        notes=_notes(config),
    )
    for line in report.lines(config):
        logger.info("%s", line)
    return report

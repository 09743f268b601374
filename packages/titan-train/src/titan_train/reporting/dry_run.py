"""A dry run: check a config and its layout for N GPUs on any machine, and trace its memory per rank.

torch's fake process-group backend lets one CPU process build the real device mesh of a 512-rank job
(it answers every collective without communicating), and fake tensors let it run a training step of
each distinct rank without memory or compute (see `memory_estimate`). What this cannot check is the
GPUs themselves: kernels, bandwidth, the CUDA context and communication libraries' own buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_parallel import ParallelDims
from titan_train.config.grpo_section import is_prompts
from titan_train.config.unsupported import UnsupportedConfigError, refuse_unsupported
from titan_train.errors import ConfigError
from titan_train.plan import ParamCounts, RunPlan, resolve
from titan_train.reporting.device_peaks import DEVICE_MEMORY_GIB
from titan_train.reporting.memory_estimate import GIB, MemoryEstimate, estimate_memory
from titan_train.reporting.rollout_memory import (
    RolloutMemory,
    generates_with_titan,
    rollout_lines,
    rollout_memory,
)

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
    device_name: str = ""
    device_memory: int = 0
    levers: list[str] = field(default_factory=list)
    rollout_share: int = 0  # bytes of rank 0's GPU a vLLM server the run starts holds (`rollout_share`)
    rollouts: RolloutMemory | None = None  # what the titan engine's generation adds (`rollout_memory`)

    def lines(self, config: Any) -> list[str]:
        t = config.training
        out = [
            f"dry run: {config.model.name} {config.model.flavor} on {self.world_size} ranks "
            "(fake process group: the layout is built, nothing is computed)",
            f"  mesh: {self.mesh}",
            f"  parameters: {self.params.total:,} ({self.params.embedding:,} in the embedding, "
            f"{self.params.n_blocks} blocks of {self.params.per_block:,})",
            f"  batch: {t.local_batch_size} sequence{'s' if t.local_batch_size != 1 else ''} of {t.seq_len} tokens per data-parallel rank, "
            f"gradient accumulation {self.grad_accum_steps}: {self.tokens_per_step:,} tokens per step",
        ]
        out += self.memory_lines(config)
        out += [f"  note: {note}" for note in self.notes]
        return out

    def memory_lines(self, config: Any) -> list[str]:
        m, gib = self.memory, 2**30
        ac = config.activation_checkpoint
        how = "fake tensors" if m.fake else "real tensors (memory_estimation.disable_fake_mode)"
        depth = f"{'/'.join(map(str, m.traced_blocks))} blocks per stage, scaled to {m.blocks_per_stage}"
        if m.traced_blocks == (m.blocks_per_stage,):
            depth = f"all {m.blocks_per_stage} blocks per stage"
        out = [
            f"  memory per rank, traced: one training step on {how}, {depth}, activation checkpointing "
            f"'{ac.mode}'{'' if ac.mode != 'selective' else ' ' + ac.selective_ac_option}, {m.seconds:.1f} s:"
        ]
        for r in m.ranks:
            out.append(
                f"    rank {r.rank} (pp stage {r.pp_rank}): peak allocated {r.allocated / gib:.2f} GiB at {r.where}; "
                f"expected peak reserved {r.reserved / gib:.2f} GiB (expandable segments), "
                f"{r.reserved_fixed_segments / gib:.2f} GiB (fixed segments)"
            )
        out += [f"    ({note})" for note in m.notes]
        out.append(f"    at the peak of rank {m.worst.rank}:")
        out += [f"      {name:<46}{size / gib:>9.2f} GiB" for name, size in m.rows()]
        if self.device_memory:
            out += self.headroom_lines()
        if self.rollouts is not None:
            out += rollout_lines(self.rollouts, m.worst.breakdown, self.device_memory)
        return out

    def headroom_lines(self) -> list[str]:
        m, gib, cap = self.memory, 2**30, self.device_memory
        need = m.expected_reserved(m.worst)
        mode = "expandable" if m.expandable_segments else "fixed"
        out = [
            f"  headroom on {self.device_name} ({cap / gib:.1f} GiB): {(cap - need) / gib:+.2f} GiB against the expected "
            f"peak reserved ({mode} segments; the CUDA context and NCCL buffers, about 1-2 GiB, are not traced)"
        ]
        if need > cap:
            out.append("  over budget; levers that would make it fit:" if self.levers else "  over budget.")
            out += [f"    - {lever}" for lever in self.levers]
        if self.rollout_share:
            first = next((r for r in m.ranks if r.rank == 0), m.worst)
            left = cap - self.rollout_share - m.expected_reserved(first)
            out.append(
                f"  rank 0's GPU also holds the vLLM server the run starts ({self.rollout_share / gib:.2f} GiB, "
                f"grpo.vllm_gpu_memory_utilization of it): {left / gib:+.2f} GiB headroom there"
                + (
                    "; over budget: lower the share, or give grpo.vllm_url (a server on GPUs of its own)"
                    if left < 0
                    else ""
                )
            )
        return out


def rollout_share(config: Any, capacity: int) -> int:
    """What a vLLM server the run starts takes of the GPU it shares with rank 0 (vLLM claims its
    gpu_memory_utilization of the whole device at start); 0 for the titan engine or a server at a URL."""
    g = config.grpo
    if not is_prompts(config.training) or g.engine != "vllm" or g.vllm_url is not None:
        return 0
    return int(g.vllm_gpu_memory_utilization * capacity)


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
    experts = f"; experts: ep={dims.ep}, etp={dims.etp}, efsdp={dims.efsdp}" if dims.ep > 1 else ""
    return f"({shape}){flat}{experts}"


def device_memory_of(device: str, memory_gib: float | None) -> tuple[str, int]:
    """The device a dry run plans for and its memory in bytes (`--device-memory-gib` wins over the table)."""
    if memory_gib is not None:
        return (device or "the device"), int(memory_gib * GIB)
    if device not in DEVICE_MEMORY_GIB:
        raise ConfigError(
            f"dry run: --device {device} is not in the table ({', '.join(DEVICE_MEMORY_GIB)}); "
            "give its memory with --device-memory-gib"
        )
    return device, int(DEVICE_MEMORY_GIB[device] * GIB)


def dry_run(
    config: Any, world_size: int, device: str = "H100", device_memory_gib: float | None = None
) -> DryRunReport:
    """Resolve `config` for `world_size` ranks, build its mesh, trace its memory per rank and log it all."""
    device_name, capacity = device_memory_of(device, device_memory_gib)
    try:
        plan = resolve(config, world_size, "cuda")
    except ConfigError as err:
        raise ConfigError(f"dry run: the layout does not work: {err}") from None
    _fake_world(world_size)
    try:
        dims = replace(plan.dims)  # a mesh of its own: the plan's degrees stay free of this fake world
        dims.build_mesh("cpu")
        mesh = _describe_mesh(dims)
    finally:
        dist.destroy_process_group()

    fake = not config.memory_estimation.disable_fake_mode
    memory = estimate_memory(plan, fake=fake, capacity=capacity)
    report = DryRunReport(
        world_size=world_size,
        degrees=plan.dims.degrees,
        mesh=mesh,
        params=plan.params,
        grad_accum_steps=plan.grad_accum_steps,
        tokens_per_step=plan.tokens_per_step,
        memory=memory,
        notes=_notes(config),
        device_name=device_name,
        device_memory=capacity,
        rollout_share=rollout_share(config, capacity),
        rollouts=rollout_memory(plan) if generates_with_titan(config) else None,
    )
    if memory.expected_reserved(memory.worst) > capacity:
        report.levers = memory_levers(plan, memory, capacity)
    for line in report.lines(config):
        logger.info("%s", line)
    return report


def memory_levers(plan: RunPlan, memory: MemoryEstimate, capacity: int) -> list[str]:
    """What would bring an over-budget layout under `capacity`, each re-traced (its config resolved
    again) or scaled from the breakdown."""
    config, world_size = plan.config, plan.world_size
    gib, levers = 2**30, []
    worst = memory.worst
    need = memory.expected_reserved(worst)
    ac, t, p = config.activation_checkpoint, config.training, config.parallelism
    tried = []
    if ac.mode != "full":
        tried.append(
            (
                "activation_checkpoint.mode full",
                replace(config, activation_checkpoint=replace(ac, mode="full")),
            )
        )
    if t.local_batch_size > 1 and p.pipeline_parallel_degree == 1:
        half = t.local_batch_size // 2
        tried.append(
            (f"training.local_batch_size {half}", replace(config, training=replace(t, local_batch_size=half)))
        )
    for name, changed in tried:
        try:
            m = estimate_memory(
                resolve(changed, world_size, plan.device_type), fake=memory.fake, capacity=capacity
            )
        except Exception as err:  # a lever the layout refuses is no lever
            logger.debug("lever %s: %s", name, err)
            continue
        got = m.expected_reserved(m.worst)
        levers.append(f"{name}: {got / gib:.2f} GiB{' (fits)' if got <= capacity else ''}")
    sharded = sum(worst.breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer state"))
    if sharded:
        doubled = need - sharded / 2
        levers.append(
            f"twice the FSDP shards (data_parallel_shard_degree x2, more GPUs or from replicate): about "
            f"{doubled / gib:.2f} GiB{' (fits)' if doubled <= capacity else ''}"
        )
    return levers
